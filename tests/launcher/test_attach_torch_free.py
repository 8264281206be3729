"""`disagg-epd-proxy` in attach mode, as a real process in front of a fake decoder: it serves with neither torch nor
transformers imported, and under the name of the model its workers report."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.hostile.test_lifecycle import IDENTITY, FakeWorker
from tests.ports import REUSE_PORT_ENV, PortHolds

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")
# the CLI as its console script runs it, reporting at exit which heavy modules were ever imported
PROBE = f"""import atexit, signal, sys
atexit.register(lambda: print("HEAVY=" + ",".join(m for m in {HEAVY!r} if m in sys.modules), flush=True))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
from epd_launcher.cli import main
main(sys.argv[1:])
"""


def serving(base: str, proc: subprocess.Popen[bytes], log: Path, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end, log.read_text()
        time.sleep(0.1)


def test_attach_mode_serves_without_torch_under_the_workers_model_name(port_holds: PortHolds, tmp_path: Path) -> None:
    decoder = FakeWorker({"status": "ok", "model": "/models/Qwen2-VL-2B/", "model_identity": IDENTITY})
    port, log = port_holds.take(), tmp_path / "proxy.log"  # held for the proxy's life: it binds beside the hold
    argv = ["--insecure", "--aggregated", "--decode-servers-urls", decoder.url, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **REUSE_PORT_ENV}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", PROBE, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        serving(base, proc, log)
        models = httpx.get(f"{base}/v1/models", timeout=10).json()
        wrong = httpx.post(f"{base}/v1/chat/completions", timeout=10,
                           json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]})
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        decoder.close()
    assert [m["id"] for m in models["data"]] == ["Qwen2-VL-2B"]
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    assert "'Qwen2-VL-2B'" in wrong.json()["error"]["message"]
    assert code == 0 and "HEAVY=\n" in log.read_text(), log.read_text()[-3000:]
