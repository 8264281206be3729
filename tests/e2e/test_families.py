"""Every family end to end: `disagg-epd-proxy --model DIR` (1 encoder and 1 decoder process, images over ZeroMQ)
answers a chat request token for token as the aggregated mode does, and each worker's /health names the model.

Cost (the whole point of the layout): one launcher per family, ~20 s on two busy cores (three interpreters that
import torch and transformers, ~30 s of CPU); the aggregated side runs in this process instead (its decoder and
proxy apps behind uvicorn threads, as tests/hostile/test_disconnect.py does), with the same
DecoderConfig(aggregated=True) and ProxyConfig(aggregated=True) that `--aggregated` gives its processes, for a
model load of about a second. Measured: 23-33 s per family with its tiny build, 4 min 47 s for ten families.
"""
from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_builders.tiny import FAMILIES, TinySpec
from epd_models.identity import model_identity, served_name
from tests.e2e.answers import aggregated, logprobs, tokens
from tests.e2e.stack import Stack, health, launched, urls_of
from tests.factories import make_image

MAX_TOKENS = 6
CASES = {  # (width, height, colour) per image
    "text_only": [],
    "one_image": [(200, 150, "green")],  # LLaVA-OneVision: all its tiles (in a two-image prompt: the base tile only)
    "two_images_of_different_sizes": [(224, 224, "red"), (168, 112, "blue")],
}


@dataclass
class Pair:
    family: str
    model_dir: Path
    epd: Stack  # disagg-epd-proxy --model DIR, 1 encoder + 1 decoder
    aggregated: str  # base URL of the in-process aggregated proxy


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, Path],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    family = str(request.param)
    model_dir = tiny_model_dirs[family]
    with launched(tmp_path_factory.mktemp(f"family-{family}"), "--model", str(model_dir), "--num-encoders", "1",
                  "--num-decoders", "1") as epd, aggregated(model_dir) as agg:
        yield Pair(family, model_dir, epd, agg)


def _png(width: int, height: int, colour: str) -> str:
    buf = io.BytesIO()
    make_image(width, height, colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(base_url: str, model: str, images: list[tuple[int, int, str]]) -> dict[str, Any]:
    """A greedy chat completion with `images` before the question; each token's logprob entry included."""
    parts = [{"type": "image_url", "image_url": {"url": _png(*im)}} for im in images]
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is in the picture?"}]}]}
    resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES)
def test_epd_answers_as_the_aggregated_mode(pair: Pair, case: str) -> None:
    epd, agg = (chat(url, pair.family, CASES[case]) for url in (pair.epd.base_url, pair.aggregated))
    assert epd["usage"]["completion_tokens"] == MAX_TOKENS and tokens(epd) == tokens(agg)
    assert logprobs(epd) == pytest.approx(logprobs(agg), abs=1e-4)
    assert epd["choices"][0]["message"]["content"] == agg["choices"][0]["message"]["content"]
    assert epd["usage"] == agg["usage"]  # prompt_tokens counts every image token, on both paths


@pytest.mark.e2e
def test_the_images_reach_the_language_model(pair: Pair) -> None:
    """Not vacuous: the same two images in the other order change what the model says."""
    images = CASES["two_images_of_different_sizes"]
    ordered, swapped = chat(pair.epd.base_url, pair.family, images), chat(pair.epd.base_url, pair.family, images[::-1])
    assert ordered["usage"]["prompt_tokens"] == swapped["usage"]["prompt_tokens"]
    assert logprobs(ordered) != pytest.approx(logprobs(swapped), abs=1e-4)


@pytest.mark.e2e
def test_every_worker_reports_the_family_served_name_and_hidden_size(pair: Pair) -> None:
    expected = model_identity(pair.model_dir)
    workers = [health(u) for role in ("encoders", "decoders") for u in urls_of(pair.epd, role)]
    assert [w["role"] for w in workers] == ["encoder", "decoder"]
    for w in workers:
        assert w["model_identity"] == expected
        assert (expected["family"], expected["served_name"], expected["hidden_size"]) == (
            pair.family, pair.family, TinySpec().text_hidden)
    models = httpx.get(f"{pair.epd.base_url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [pair.family]  # the name clients send: the checkpoint dir's name


def test_served_name_is_the_last_part_of_a_path_or_hub_id() -> None:
    assert [served_name(m) for m in ("demo", "bench", "/models/Qwen2-VL-7B/", "Qwen/Qwen3-VL-8B-Instruct")] == [
        "demo", "bench", "Qwen2-VL-7B", "Qwen3-VL-8B-Instruct"]


def test_identity_names_the_model_as_served_and_fingerprints_the_checkpoint(tmp_path: Path) -> None:
    """llava-1.5-7b-hf's config.json leaves out the text hidden size (LlamaConfig's default, 4096): the identity
    must read it from the config class, not the JSON."""
    config = {"model_type": "llava", "text_config": {"model_type": "llama", "vocab_size": 32064}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ident = model_identity(tmp_path, "llava-hf/llava-1.5-7b-hf")
    assert (ident["family"], ident["served_name"], ident["hidden_size"]) == ("llava", "llava-1.5-7b-hf", 4096)
    assert model_identity(tmp_path)["served_name"] == tmp_path.name
    assert model_identity(tmp_path)["fingerprint"] == ident["fingerprint"]  # the name is not part of the checkpoint
