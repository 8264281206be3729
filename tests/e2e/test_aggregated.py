"""Aggregated mode: no encoders; the decoder loads both halves and encodes images sent inline."""
from __future__ import annotations

import base64
import io
import random
from collections.abc import Iterator

import httpx
import pytest

from models.shapes import draw_shape
from tests.e2e.stack import Stack, health, launched

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launched(tmp_path_factory.mktemp("agg"), "--model", "demo", "--aggregated", "--num-decoders", "1") as s:
        yield s


def ask(stack: Stack, image: bytes) -> httpx.Response:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What color is the shape?"}]
    body = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)


def png(colour: str, seed: int) -> bytes:
    buf = io.BytesIO()
    draw_shape(colour, "square", random.Random(seed)).save(buf, format="PNG")
    return buf.getvalue()


def test_one_process_encodes_and_decodes(stack: Stack) -> None:
    info = stack.get("/health").json()
    assert info["encoders"] == [] and len(info["decoders"]) == 1
    decoder = health(info["decoders"][0])
    assert decoder["aggregated"] and {"vision_tower", "language_model"} <= set(decoder["loaded"]["modules"])
    for colour, seed in (("red", 1), ("blue", 2), ("red", 1)):
        resp = ask(stack, png(colour, seed))
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == colour
    assert health(info["decoders"][0])["loaded"]["num_encoded"] == 2  # the repeated image was encoded once


def test_a_broken_image_is_a_400_and_the_next_request_succeeds(stack: Stack) -> None:
    resp = ask(stack, png("green", 3)[:60])
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_image"
    assert ask(stack, png("green", 4)).json()["choices"][0]["message"]["content"] == "green"
