"""The connector must never deserialize with pickle or its relatives."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

FORBIDDEN = {"pickle", "cloudpickle", "dill", "marshal", "_pickle", "joblib"}
CONNECTOR_DIR = Path(__file__).resolve().parents[2] / "connector"


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module a source file imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_connector_module_imports_pickle_like_serializers() -> None:
    sources = sorted(CONNECTOR_DIR.glob("**/*.py"))
    assert len(sources) >= 5, f"connector sources not found under {CONNECTOR_DIR}"
    offenders = {p.name: sorted(imported_modules(p) & FORBIDDEN) for p in sources}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_import_checker_catches_a_pickle_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom pickle import loads\nimport dill.source\n")
    assert imported_modules(bad) & FORBIDDEN == {"pickle", "dill"}


# methods that pickle (pyzmq) or take a serializer, dunders pickle calls, and calls that pickle or run code
FORBIDDEN_ATTRS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized", "__reduce__", "__reduce_ex__"}
FORBIDDEN_CALLS = {"torch.load", "torch.save", "torch.serialization.load", "numpy.load", "np.load", "eval", "exec"}


def dotted_name(node: ast.expr) -> str:
    """`a.b.c` for a Name/Attribute chain, else ''."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def forbidden_uses(path: Path) -> set[str]:
    """Every pickling method, dunder or code-running call a source file names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRS:
            found.add(node.attr)
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_ATTRS:
            found.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in FORBIDDEN_ATTRS:
            found.add(node.value)  # getattr(sock, "recv_pyobj")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in FORBIDDEN_ATTRS:
            found.add(node.name)
        elif isinstance(node, ast.Call) and dotted_name(node.func) in FORBIDDEN_CALLS:
            found.add(dotted_name(node.func))
        elif isinstance(node, ast.ImportFrom) and node.module in {"torch", "numpy"}:
            found.update(f"{node.module}.{a.name}" for a in node.names if a.name in {"load", "save"})
    return found


def test_no_connector_module_calls_pickling_or_code_running_functions() -> None:
    offenders = {p.name: sorted(forbidden_uses(p)) for p in sorted(CONNECTOR_DIR.glob("**/*.py"))}
    assert {name: uses for name, uses in offenders.items() if uses} == {}


def test_call_checker_catches_pickling_calls(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch, numpy as np\nfrom torch import load\n"
        "def f(sock, x):\n    sock.send_pyobj(x)\n    getattr(sock, 'recv_pyobj')()\n    torch.save(x, 'p')\n"
        "    np.load('p')\n    eval('1')\n    return x.__reduce_ex__(2)\n"
        "class C:\n    def __reduce__(self):\n        return (C, ())\n"
    )
    assert forbidden_uses(bad) == {"torch.load", "send_pyobj", "recv_pyobj", "torch.save", "np.load", "eval",
                                   "__reduce_ex__", "__reduce__"}


ROUND_TRIP = r"""
import json, pickle, _pickle
import msgpack, msgspec, numpy, torch, zmq  # third-party imports come first; only the connector runs under the trap

calls = []

def trap(name):
    def called(*args, **kwargs):
        calls.append(name)
        raise RuntimeError(f"{name} called")
    return called

for module in (pickle, _pickle):
    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        setattr(module, name, trap(f"{module.__name__}.{name}"))

from connector.control.wire import MAGIC_VERSION, decode_message
from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from connector.tensors.kv_client import KVClient
from connector.tensors.kv_server import KVServer
from connector.tensors.kv_store import KVStore
from epd_contracts.ec import ErrorReply
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.kv import KVChoice, KVLayout

outs = {
    "f32": ImageFeatures(torch.randn(5, 8)),
    "f16": ImageFeatures(torch.randn(3, 8).half()),
    "bf16": ImageFeatures(torch.randn(4, 8).to(torch.bfloat16), (1, 2, 2)),
    "empty": ImageFeatures(torch.empty(0, 8)),
}
producer = ECProducer().start()
consumer = ECConsumer()
try:
    for h, out in outs.items():
        producer.save_caches(h, out)
    got = consumer.gather(list(outs), {h: producer.address for h in outs}, timeout=10)
    for h, out in outs.items():
        back = got[h]
        assert back.embeds.dtype == out.embeds.dtype and torch.equal(back.embeds, out.embeds), h
        assert back.grid_thw == out.grid_thw, h
    assert consumer.query(producer.address, ["f32", "nope"], timeout=10) == [True, False]
    assert consumer.ping(producer.address, timeout=10)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(producer.address)
    raw.send_multipart([MAGIC_VERSION + b"\xc1\xc1"])  # valid magic, bad msgpack
    assert raw.poll(10_000), "no reply to a malformed message"
    assert isinstance(decode_message(raw.recv_multipart())[0], ErrorReply)
    raw.close(linger=0)
    layout = KVLayout(fingerprint="m", num_layers=2, kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
    blocks = torch.randn(3, *layout.block_shape).to(torch.bfloat16)
    store = KVStore(1 << 20, 60)
    store.put("k", layout, 10, blocks, [KVChoice(first_token=1, generator_state=b"s")])
    kv_server, kv_client = KVServer(store).start(), KVClient()
    try:
        assert torch.equal(kv_client.fetch(kv_server.address, "k", layout, timeout=10).blocks, blocks)
    finally:
        kv_client.close()
        kv_server.close()
finally:
    consumer.close()
    producer.close()
try:
    pickle.dumps(1)  # canary: the trap itself works
except RuntimeError:
    pass
print(json.dumps(calls))
"""


def test_round_trip_over_tcp_never_calls_pickle() -> None:
    repo = CONNECTOR_DIR.parent
    run = subprocess.run([sys.executable, "-c", ROUND_TRIP], cwd=repo, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == ["pickle.dumps"], run.stderr[-3000:]
