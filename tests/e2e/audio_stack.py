"""What the audio end-to-end tests share: a tiny audio checkpoint behind EPD (two encoders) and behind the aggregated
mode, the audio parts, and answers compared as the video tests compare them."""
from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_builders.audio_tiny import AudioTinySpec, build_audio_tiny
from tests.e2e.answers import aggregated, logprobs, tokens
from tests.e2e.stack import Stack, health, launched, urls_of
from tests.openai_schema import assert_valid

MAX_TOKENS = 6


@dataclass
class Pair:
    epd: Stack
    aggregated: str
    model: str


def audio_stack(family: str, tmp: Path, *flags: str) -> Iterator[Pair]:
    """A tiny `family` checkpoint behind EPD (two encoders, `flags`) and behind the aggregated mode."""
    model_dir = build_audio_tiny(AudioTinySpec(family=family, lm_scale=3.0), tmp / family)
    (tmp / "epd").mkdir()
    with launched(tmp / "epd", "--model", str(model_dir), "--num-encoders", "2", "--num-decoders", "1",
                  *flags) as epd, aggregated(model_dir) as agg:
        yield Pair(epd, agg, model_dir.name)


def input_audio(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def audio_url(data: bytes, mime: str = "audio/wav") -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}


def ask(base_url: str, model: str, *parts: dict[str, Any], **extra: Any) -> httpx.Response:
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}], **extra}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)


def answer(base_url: str, model: str, *parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    resp = ask(base_url, model, *parts, **extra)
    assert resp.status_code == 200, resp.text
    out = dict(resp.json())
    assert_valid("CreateChatCompletionResponse", out)
    return out


def assert_same(epd: dict[str, Any], agg: dict[str, Any]) -> None:
    assert epd["usage"]["completion_tokens"] == MAX_TOKENS and tokens(epd) == tokens(agg)
    assert logprobs(epd) == pytest.approx(logprobs(agg), abs=1e-4)
    assert epd["usage"]["prompt_tokens"] == agg["usage"]["prompt_tokens"]


def encoded(stack: Stack) -> list[int]:
    return [int(health(u)["num_encoded"]) for u in urls_of(stack, "encoders")]
