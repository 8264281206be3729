"""LoRA adapters end to end: the launcher passes --enable-lora and --lora-modules to its decoder, the proxy lists
the adapters in /v1/models and sends a request naming one to it; the adapter changes the answer, the same way every
time, and the base model's answers are unchanged beside it; adapters loaded and unloaded at runtime through the
proxy serve (or stop) at once, and a path outside --allowed-lora-dir is a 400."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from epd_models.resolve import resolve_model
from tests.e2e.stack import Stack, ask_colour, demo_png, health, launched, urls_of
from tests.lora_adapters import make_adapter
from tests.models.test_lora_vision import VISION_TARGETS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def stack(tmp: Path) -> Iterator[Stack]:
    model = resolve_model("demo")
    a, b = (make_adapter(model, tmp / name, seed=i, rank=8) for i, name in enumerate("ab"))
    v = make_adapter(model, tmp / "v", seed=5, rank=8, targets=VISION_TARGETS)  # the vision tower's too
    make_adapter(model, tmp / "allowed" / "c", seed=2, rank=8)
    with launched(tmp, "--model", "demo", "--num-encoders", "1", "--num-decoders", "1", "--enable-lora",
                  "--max-loras", "4", "--lora-modules", f"a={a}", f'{{"name": "b", "path": "{b}"}}', f"v={v}",
                  "--enable-lora-runtime-updating", "--allowed-lora-dir", str(tmp / "allowed")) as s:
        yield s


def test_models_lists_the_adapters_with_their_parent(stack: Stack) -> None:
    data = httpx.get(f"{stack.base_url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("demo", None), ("a", "demo"), ("b", "demo"),
                                                           ("v", "demo")]


def test_an_adapter_answers_under_its_name_and_the_base_model_is_unchanged(stack: Stack) -> None:
    image = demo_png("red", 1, "square")
    base = ask_colour(stack.base_url, image)
    assert base.status_code == 200 and base.json()["choices"][0]["message"]["content"] == "red"
    answers = {}
    for name in ("a", "b", "a", "b"):
        resp = ask_colour(stack.base_url, image, model=name)
        assert resp.status_code == 200 and resp.json()["model"] == name
        answers.setdefault(name, set()).add(resp.json()["choices"][0]["message"]["content"])
    assert all(len(v) == 1 for v in answers.values()) and {"red"} not in answers.values()
    assert ask_colour(stack.base_url, image).json()["choices"][0]["message"]["content"] == "red"
    missing = ask_colour(stack.base_url, image, model="c")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_an_adapter_loaded_at_runtime_serves_at_once_and_an_unloaded_one_is_gone(stack: Stack, tmp: Path) -> None:
    allowed = tmp / "allowed"
    image = demo_png("blue", 2, "square")
    loaded = httpx.post(f"{stack.base_url}/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": "c", "lora_path": str(allowed / "c")})
    assert loaded.status_code == 200 and loaded.json()["workers"] == 1, loaded.text
    assert ask_colour(stack.base_url, image, model="c").json()["model"] == "c"
    outside = httpx.post(f"{stack.base_url}/v1/load_lora_adapter", timeout=60,
                         json={"lora_name": "d", "lora_path": str(allowed.parent / "a")})
    assert outside.status_code == 400 and "outside the allowed folder" in outside.json()["error"]["message"]
    gone = httpx.post(f"{stack.base_url}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert gone.status_code == 200
    assert ask_colour(stack.base_url, image, model="c").status_code == 404
    assert ask_colour(stack.base_url, image).json()["choices"][0]["message"]["content"] == "blue"


def test_an_adapter_on_the_vision_tower_encodes_its_images_apart(stack: Stack) -> None:
    """The launcher gives the encoder the adapters too; an image sent under "v" (whose weights reach the vision
    tower) is encoded under it, once, apart from the same image under the base model or an LM-only adapter."""
    def encoded() -> int:
        return sum(int(health(u)["num_encoded"]) for u in urls_of(stack, "encoders"))

    image = demo_png("green", 3, "square")
    before = encoded()
    base = ask_colour(stack.base_url, image)
    assert base.status_code == 200 and encoded() == before + 1
    assert ask_colour(stack.base_url, image, model="a").status_code == 200 and encoded() == before + 1  # LM only
    under = ask_colour(stack.base_url, image, model="v")
    assert under.status_code == 200 and under.json()["model"] == "v" and encoded() == before + 2
    again = ask_colour(stack.base_url, image, model="v")
    assert encoded() == before + 2 and again.json()["choices"][0]["message"] == under.json()["choices"][0]["message"]
