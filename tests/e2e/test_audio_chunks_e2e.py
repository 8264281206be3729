"""Long audio across encoders, end to end: Qwen2.5-Omni's thinker encodes 2 s windows apart, so
`disagg-epd-proxy --audio-chunk-seconds 2` cuts a 9 s clip into chunks of one window each that both encoders encode
at once; the decoder gathers them in order and answers as the aggregated mode (one process that encodes the whole
clip), a clip beside an image and a video keeps its place, and a video's sound track (mm_processor_kwargs.
use_audio_in_video) is cut into chunks like a clip and interleaved with the video's frames. The chunks' rows equal the whole clip's to ~1e-7
(epd_models/qwen2_5_omni.py), so tokens are equal and logprobs within 1e-4. Phi-4-multimodal the same with its 40 s
windows (exact)."""
from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest

from tests.audio_clips import make_audio, make_video_with_audio
from tests.e2e.answers import logprobs
from tests.e2e.audio_stack import Pair, answer, ask, assert_same, audio_stack, encoded, input_audio
from tests.factories import make_image, make_video

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    yield from audio_stack("qwen2_5_omni", tmp_path_factory.mktemp("audio-chunks"), "--audio-chunk-seconds", "2")


def image_part(colour: str) -> dict[str, Any]:
    buf = io.BytesIO()
    make_image(56, 56, colour).save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


def video_part() -> dict[str, Any]:
    clip = make_video(num_frames=4, width=56, height=56, fps=2)
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(clip).decode()}}


def test_a_long_clip_in_chunks_on_two_encoders_answers_as_the_whole_clip(pair: Pair) -> None:
    before = encoded(pair.epd)
    part = input_audio(make_audio("wav", seconds=9.0, rate=16_000, channels=1, freq=300.0))
    epd = answer(pair.epd.base_url, pair.model, part)
    assert_same(epd, answer(pair.aggregated, pair.model, part))
    grew = [after - b for after, b in zip(encoded(pair.epd), before, strict=True)]
    assert sum(grew) == 5 and all(g >= 1 for g in grew), grew  # 4.5 windows: 5 chunks, the last to the end


def test_a_clip_with_an_image_and_a_video_keeps_its_place(pair: Pair) -> None:
    clip = input_audio(make_audio("wav", seconds=3.0, rate=16_000, channels=1, freq=600.0))
    parts = [image_part("red"), clip, video_part()]
    epd = answer(pair.epd.base_url, pair.model, *parts)
    assert_same(epd, answer(pair.aggregated, pair.model, *parts))
    moved = answer(pair.epd.base_url, pair.model, clip, parts[0], parts[2])
    assert moved["usage"]["prompt_tokens"] == epd["usage"]["prompt_tokens"]
    assert logprobs(moved) != pytest.approx(logprobs(epd), abs=1e-4)


def test_a_video_with_its_sound_track_answers_as_the_aggregated_mode(pair: Pair) -> None:
    """A 6 s video (12 frames at 2 fps: 6 temporal patches) with a 6 s AAC track: the track is 3 chunks of one 2 s
    window, spread over the encoders beside the video's own; the prompt holds the track's rows (150) and its two
    marks more than the video alone, and the answer is the aggregated mode's."""
    data = make_video_with_audio(12, 2.0, 6.0, freq=350.0)
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}
    track = {"mm_processor_kwargs": {"use_audio_in_video": True}}
    before = encoded(pair.epd)
    epd = answer(pair.epd.base_url, pair.model, part, **track)
    assert_same(epd, answer(pair.aggregated, pair.model, part, **track))
    grew = [after - b for after, b in zip(encoded(pair.epd), before, strict=True)]
    alone = answer(pair.epd.base_url, pair.model, part)
    assert epd["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"] + 150 + 2
    assert sum(grew) >= 3 and all(g >= 1 for g in grew), grew  # the track's 3 chunks and the video's
    assert logprobs(alone) != pytest.approx(logprobs(epd), abs=1e-4)


def test_a_silent_video_with_use_audio_in_video_is_a_400(pair: Pair) -> None:
    resp = ask(pair.epd.base_url, pair.model, video_part(), mm_processor_kwargs={"use_audio_in_video": True})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "video_has_no_audio"
    assert resp.json()["error"]["param"] == "messages.0.content.0.video_url.url"


@pytest.fixture(scope="module")
def phi4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    yield from audio_stack("phi4_multimodal", tmp_path_factory.mktemp("audio-phi4"), "--audio-chunk-seconds", "40")


def test_phi4_long_clip_in_40_s_windows_on_two_encoders_answers_as_the_whole_clip(phi4: Pair) -> None:
    """Phi-4-multimodal's encoder attends within 40 s windows, computed apart exactly: a 45 s clip is 2 chunks,
    each encoded once (on their rendezvous homes: one encoder or both), and the answer is the aggregated mode's."""
    before = encoded(phi4.epd)
    part = input_audio(make_audio("wav", seconds=45.0, rate=16_000, channels=1, freq=250.0))
    assert_same(answer(phi4.epd.base_url, phi4.model, part), answer(phi4.aggregated, phi4.model, part))
    grew = [after - b for after, b in zip(encoded(phi4.epd), before, strict=True)]
    assert sum(grew) == 2 and all(g >= 0 for g in grew), grew
