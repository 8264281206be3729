"""Aggregated mode: no encoders; the decoder loads both halves and encodes images sent inline."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.stack import Stack, ask_colour, demo_png, health, launched

pytestmark = pytest.mark.e2e
KEY = "test-key"  # this stack also checks --api-key


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launched(tmp_path_factory.mktemp("agg"), "--model", "demo", "--aggregated", "--num-decoders", "1",
                  "--api-key", KEY) as s:
        yield s


def test_one_process_encodes_and_decodes(stack: Stack) -> None:
    info = stack.info()
    assert info["encoders"] == [] and len(info["decoders"]) == 1
    decoder = health(info["decoders"][0]["url"])
    assert decoder["aggregated"] and {"vision_tower", "language_model"} <= set(decoder["loaded"]["modules"])
    for colour, seed in (("red", 1), ("blue", 2), ("red", 1)):
        resp = ask_colour(stack.base_url, demo_png(colour, seed, "square"), api_key=KEY)
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == colour
    assert health(info["decoders"][0]["url"])["loaded"]["num_encoded"] == 2  # the repeated image was encoded once


def test_a_broken_image_is_a_400_and_the_next_request_succeeds(stack: Stack) -> None:
    resp = ask_colour(stack.base_url, demo_png("green", 3, "square")[:60], api_key=KEY)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_image"
    resp = ask_colour(stack.base_url, demo_png("green", 4, "square"), api_key=KEY)
    assert resp.json()["choices"][0]["message"]["content"] == "green"


def test_the_api_key_is_required(stack: Stack) -> None:
    missing = ask_colour(stack.base_url, demo_png("red", 5, "square"))
    wrong = ask_colour(stack.base_url, demo_png("red", 5, "square"), api_key="nope")
    assert missing.status_code == wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert ask_colour(stack.base_url, demo_png("red", 5, "square"), api_key=KEY).status_code == 200
    assert stack.get("/health").status_code == 200  # probes need no key
