"""Runtime LoRA updates on the decoder (POST /v1/load_lora_adapter, /v1/unload_lora_adapter): behind the internal
key and --enable-lora-runtime-updating; each hostile load (outside --allowed-lora-dir, a rank above --max-lora-rank,
NaN weights, a huge file, a name taken, past --max-cpu-loras) is a 400 naming why and changes nothing; loading and
unloading while a stream runs leaves that stream's answer unchanged, and an unloaded adapter takes no new request."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from decoder_service.config import DecoderConfig
from decoder_service.server import create_app
from epd_common.lora_flags import LoRAModule
from epd_models.halves import LanguageHalf
from epd_models.lora.peft_format import WEIGHTS
from tests.lora_adapters import make_adapter
from tests.openai_schema import assert_valid

KEY = {"Authorization": "Bearer k"}
MESSAGES = [{"role": "user", "content": "Name three colours and describe each one."}]


@pytest.fixture(scope="module")
def folders(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-runtime")
    allowed = root / "allowed"
    model = tiny_model_dirs["llava"]
    out = {name: make_adapter(model, allowed / name, seed=i, rank=8) for i, name in enumerate(("a", "b", "c"))}
    out["outside"] = make_adapter(model, root / "outside", seed=4, rank=8)
    out["big-rank"] = make_adapter(model, allowed / "big-rank", seed=5, rank=32)
    nan = shutil.copytree(out["b"], allowed / "nan")
    state = load_file(str(nan / WEIGHTS))
    state[next(iter(state))][0, 0] = float("nan")
    save_file(state, str(nan / WEIGHTS))
    huge = shutil.copytree(out["b"], allowed / "huge")
    with open(huge / WEIGHTS, "r+b") as f:
        f.truncate(64 << 30)
    return {"root": allowed, "nan": nan, "huge": huge, **out}


@pytest.fixture
def client(tiny_model_dirs: dict[str, Path], folders: dict[str, Path]) -> Iterator[TestClient]:
    cfg = DecoderConfig(max_num_seqs=4, max_model_len=512, internal_key="k", enable_lora=True, max_loras=2,
                        enable_lora_runtime_updating=True, allowed_lora_dir=str(folders["root"]),
                        lora_modules=(LoRAModule("a", str(folders["a"])),))
    with TestClient(create_app(cfg, lm=LanguageHalf(tiny_model_dirs["llava"]))) as c:
        yield c


def body(lora: str = "", max_tokens: int = 24) -> dict[str, Any]:
    return {"messages": MESSAGES, "lora": lora,
            "sampling": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}


def answer(client: TestClient, lora: str) -> str:
    resp = client.post("/generate", json=body(lora), headers=KEY)
    assert resp.status_code == 200, resp.text
    return "".join(json.loads(line).get("text", "") for line in resp.text.splitlines() if line.strip())


def loras(client: TestClient) -> list[str]:
    return [a["name"] for a in client.get("/health").json().get("loras", [])]


def load(client: TestClient, name: str, path: Path, headers: dict[str, str] = KEY) -> Any:
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, headers=headers)


def test_the_internal_key_is_required(client: TestClient, folders: dict[str, Path]) -> None:
    assert load(client, "b", folders["b"], headers={}).status_code == 401
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 401
    assert loras(client) == ["a"]


@pytest.mark.parametrize("name, folder, says", [
    ("x", "outside", "outside the allowed folder"),
    ("x", "big-rank", "rank 32 is above --max-lora-rank 16"),
    ("x", "nan", "not finite"),
    ("x", "huge", "more than an adapter of rank <= 16"),
    ("a", "b", "'a' is already loaded"),
])
def test_a_hostile_load_is_a_400_naming_why_and_changes_nothing(client: TestClient, folders: dict[str, Path],
                                                                name: str, folder: str, says: str) -> None:
    before = answer(client, "a")
    resp = load(client, name, folders[folder])
    assert resp.status_code == 400 and says in resp.json()["error"]["message"], resp.text
    assert_valid("ErrorResponse", resp.json())
    assert loras(client) == ["a"] and answer(client, "a") == before


def test_past_max_cpu_loras_a_load_is_refused(client: TestClient, folders: dict[str, Path]) -> None:
    """--max-cpu-loras 0 is --max-loras 2: the adapters known at once, resident or not."""
    assert load(client, "b", folders["b"]).status_code == 200
    resp = load(client, "c", folders["c"])
    assert resp.status_code == 400 and "--max-cpu-loras 2" in resp.json()["error"]["message"]
    assert loras(client) == ["a", "b"]


def test_a_body_with_unknown_fields_or_no_name_is_a_400(client: TestClient) -> None:
    for bad in ({"lora_name": "b"}, {"lora_name": "", "lora_path": "/x"}, {"lora_name": "b", "lora_path": "/x",
                                                                           "extra": 1}):
        assert client.post("/v1/load_lora_adapter", json=bad, headers=KEY).status_code == 400


def test_loading_and_unloading_while_a_stream_runs_leaves_it_unchanged(client: TestClient,
                                                                        folders: dict[str, Path]) -> None:
    solo = answer(client, "a")
    base = answer(client, "")
    with client.stream("POST", "/generate", json=body("a"), headers=KEY) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.strip())
        assert load(client, "b", folders["b"]).status_code == 200  # a load while "a" streams
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=KEY).status_code == 200
        refused = client.post("/generate", json=body("a"), headers=KEY)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
        assert 1 in client.app.state.decoder.engine.lm.lora.loaded  # type: ignore[attr-defined]  # held by the stream
        text = "".join(json.loads(line).get("text", "") for line in [first, *lines] if line.strip())
    assert text == solo and loras(client) == ["b"]
    assert answer(client, "") == base and answer(client, "b") not in (solo, base)
    lm = client.app.state.decoder.engine.lm  # type: ignore[attr-defined]
    assert set(lm.lora.loaded) == {2} and not lm.lora.users  # a's weights went with its last stream
    assert all(m.targets <= {2} for m in lm.module.modules() if hasattr(m, "targets"))
    assert torch.isfinite(next(iter(lm.lora.loaded[2].weights.values()))[0]).all()


def test_runtime_updates_are_a_404_unless_enabled(tiny_model_dirs: dict[str, Path], folders: dict[str, Path]) -> None:
    cfg = DecoderConfig(max_num_seqs=2, max_model_len=256, enable_lora=True, max_loras=2,
                        allowed_lora_dir=str(folders["root"]))
    with TestClient(create_app(cfg, lm=LanguageHalf(tiny_model_dirs["llava"]))) as c:
        assert load(c, "b", folders["b"], headers={}).status_code == 404


def test_the_modality_defaults_names_are_not_for_runtime_loads(client: TestClient, folders: dict[str, Path]) -> None:
    """A checkpoint's own adapters load as default-mm:<modality> (decoder_service/lora_defaults.py): a runtime load
    may not take such a name, and an unload of one is refused."""
    refused = load(client, "default-mm:audio", folders["b"])
    assert refused.status_code == 400 and "default-mm:" in refused.json()["error"]["message"]
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "default-mm:audio"}, headers=KEY)
    assert gone.status_code == 400 and loras(client) == ["a"]
