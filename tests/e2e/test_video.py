"""Video end to end through real processes: `disagg-epd-proxy` with two encoders, a video cut into chunks that
both encoders encode at once, answers equal to the aggregated mode (one process that encodes the whole video),
mixed image + video prompts, a repeated video served from the encoders' caches, and a chunk lost with its encoder
encoded again.

Qwen3-VL is the family: its video prompt is the richest (a time stamp and a vision group per temporal patch, from
the frames' times in the source), DeepStack rows ride along each chunk, and its M-RoPE positions need the whole
grid, so a chunk boundary in the wrong place changes the answer. tests/decoder_service/test_video_gather.py and
tests/encoder_service/test_video_encode.py cover the other families' chunks in process.
"""
from __future__ import annotations

import base64
import io
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.e2e.answers import aggregated, logprobs, tokens
from tests.e2e.stack import Stack, health, launched, urls_of
from tests.factories import make_image, make_video

pytestmark = pytest.mark.e2e
FAMILY = "qwen3_vl"
MAX_TOKENS = 6
FRAMES = 8  # sampled from a 12-frame clip; chunks of 2 frames: 4 chunks (one temporal patch each)


@dataclass
class Pair:
    epd: Stack  # 2 encoders, 1 decoder, --video-chunk-frames 2
    aggregated: str


@pytest.fixture(scope="module")
def pair(tiny_model_dirs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    model_dir = tiny_model_dirs[FAMILY]
    with launched(tmp_path_factory.mktemp("video"), "--model", str(model_dir), "--num-encoders", "2",
                  "--num-decoders", "1", "--video-chunk-frames", "2") as epd, aggregated(model_dir) as agg:
        yield Pair(epd, agg)


def video_url(num_frames: int = 12, fps: float = 4.0, width: int = 96) -> str:
    return "data:video/mp4;base64," + base64.b64encode(make_video(num_frames, width=width, fps=fps)).decode()


def image_url(colour: str) -> str:
    buf = io.BytesIO()
    make_image(64, 64, colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(base_url: str, *media: tuple[str, str], frames: int = FRAMES) -> httpx.Response:
    """A greedy chat completion with `media` ((kind, url) in order) before the question, logprobs included."""
    parts = [{"type": f"{kind}_url", f"{kind}_url": {"url": url}} for kind, url in media]
    body = {"model": FAMILY, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "mm_processor_kwargs": {"num_frames": frames},
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}]}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)


def answer(base_url: str, *media: tuple[str, str]) -> dict[str, Any]:
    resp = ask(base_url, *media)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def encoded(stack: Stack) -> list[int]:
    return [int(health(u)["num_encoded"]) for u in urls_of(stack, "encoders")]


def assert_same(epd: dict[str, Any], agg: dict[str, Any]) -> None:
    assert epd["usage"]["completion_tokens"] == MAX_TOKENS and tokens(epd) == tokens(agg)
    assert logprobs(epd) == pytest.approx(logprobs(agg), abs=1e-4)
    assert epd["usage"]["prompt_tokens"] == agg["usage"]["prompt_tokens"]


def test_a_video_in_chunks_on_two_encoders_answers_as_the_whole_video(pair: Pair) -> None:
    before = encoded(pair.epd)
    media = ("video", video_url(12))
    epd, agg = answer(pair.epd.base_url, media), answer(pair.aggregated, media)
    assert_same(epd, agg)
    grew = [after - b for after, b in zip(encoded(pair.epd), before, strict=True)]
    assert sum(grew) == FRAMES // 2 and all(g >= 1 for g in grew), grew  # 4 chunks, both encoders took some


def test_the_video_reaches_the_language_model(pair: Pair) -> None:
    """Not vacuous: another clip (the square moves twice as far per frame) changes what the model says."""
    one, other = (answer(pair.epd.base_url, ("video", video_url(12, width=w))) for w in (96, 64))
    assert logprobs(one) != pytest.approx(logprobs(other), abs=1e-4)


def test_images_and_videos_keep_their_order(pair: Pair) -> None:
    media = [("image", image_url("red")), ("video", video_url(10)), ("image", image_url("blue"))]
    epd, agg = answer(pair.epd.base_url, *media), answer(pair.aggregated, *media)
    assert_same(epd, agg)
    swapped = answer(pair.epd.base_url, *media[::-1])
    assert swapped["usage"]["prompt_tokens"] == epd["usage"]["prompt_tokens"]
    assert logprobs(swapped) != pytest.approx(logprobs(epd), abs=1e-4)


def test_a_repeated_video_is_served_from_the_encoders_caches(pair: Pair) -> None:
    media = ("video", video_url(14))
    first = answer(pair.epd.base_url, media)
    before = encoded(pair.epd)
    again = answer(pair.epd.base_url, media)
    assert encoded(pair.epd) == before  # no chunk encoded again
    assert tokens(again) == tokens(first)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_broken_video_is_a_400_and_the_stack_serves_on(pair: Pair) -> None:
    clip = make_video(12)
    broken = "data:video/mp4;base64," + base64.b64encode(clip[: len(clip) // 3]).decode()
    resp = ask(pair.epd.base_url, ("video", broken))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_video", resp.text
    assert ask(pair.epd.base_url, ("video", video_url(12)), frames=10_000).json()["error"]["code"] == "video_too_large"
    assert answer(pair.epd.base_url, ("video", video_url(12)))["usage"]["completion_tokens"] == MAX_TOKENS


def test_chunks_lost_with_their_encoder_are_encoded_again(pair: Pair) -> None:
    """Last (it kills an encoder): the video's chunks on the killed encoder are gone; the same request still gets
    the same answer, its lost chunks encoded again by the encoder left (or the restarted one)."""
    media = ("video", video_url(16))
    first = answer(pair.epd.base_url, media)
    victim = urls_of(pair.epd, "encoders")[0]
    os.kill(pair.epd.worker_pid(victim), signal.SIGKILL)
    again = answer(pair.epd.base_url, media)
    assert tokens(again) == tokens(first)
    assert logprobs(again) == pytest.approx(logprobs(first), abs=1e-4)
