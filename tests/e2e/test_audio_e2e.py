"""Audio end to end through real processes: `disagg-epd-proxy` with two encoders and one decoder on a tiny
audio checkpoint, answers equal to the aggregated mode (one process that decodes and encodes the clip itself), for
OpenAI's input_audio and vLLM's audio_url parts, two clips in one prompt, a repeated clip served from the
encoders' caches, and a broken clip refused with the stack serving on.

Qwen2-Audio is the family here (its clips are one window each). Families that encode windows apart have their clips
cut into chunks over both encoders: tests/e2e/test_audio_chunks_e2e.py (Qwen2.5-Omni, Phi-4-multimodal).
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.audio_clips import make_audio
from tests.e2e.answers import logprobs, tokens
from tests.e2e.audio_stack import Pair, answer, ask, assert_same, audio_stack, audio_url, encoded, input_audio
from tests.openai_schema import assert_valid

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    yield from audio_stack("qwen2_audio", tmp_path_factory.mktemp("audio"))


def test_one_clip_answers_as_the_aggregated_mode(pair: Pair) -> None:
    part = input_audio(make_audio("wav", seconds=1.5, rate=16_000, channels=1, freq=330.0))
    assert_same(answer(pair.epd.base_url, pair.model, part), answer(pair.aggregated, pair.model, part))


def test_two_clips_of_other_formats_keep_their_order_and_reach_the_model(pair: Pair) -> None:
    one = audio_url(make_audio("flac", seconds=1.0, freq=220.0), "audio/flac")
    two = input_audio(make_audio("mp3", seconds=2.0, freq=880.0), "mp3")
    epd = answer(pair.epd.base_url, pair.model, one, two)
    assert_same(epd, answer(pair.aggregated, pair.model, one, two))
    swapped = answer(pair.epd.base_url, pair.model, two, one)
    assert swapped["usage"]["prompt_tokens"] == epd["usage"]["prompt_tokens"]
    assert logprobs(swapped) != pytest.approx(logprobs(epd), abs=1e-4)  # the clips' rows reach the LM, in order


def test_a_repeated_clip_is_served_from_the_encoders_caches(pair: Pair) -> None:
    part = input_audio(make_audio("wav", seconds=1.2, freq=500.0))
    first = answer(pair.epd.base_url, pair.model, part)
    before = encoded(pair.epd)
    again = answer(pair.epd.base_url, pair.model, part)
    assert encoded(pair.epd) == before and tokens(again) == tokens(first)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_broken_clip_is_a_400_and_the_stack_serves_on(pair: Pair) -> None:
    clip = make_audio("flac", seconds=2.0)
    resp = ask(pair.epd.base_url, pair.model, audio_url(clip[: len(clip) // 3], "audio/flac"))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_audio"
    assert_valid("ErrorResponse", resp.json())
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert ask(pair.epd.base_url, pair.model, image).status_code == 400  # this family takes no image
    answer(pair.epd.base_url, pair.model, input_audio(make_audio("wav", seconds=1.0)))
