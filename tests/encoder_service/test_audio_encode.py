"""/encode of audio items (epd_contracts/audio.py): the encoder hashes each clip itself (bytes and resampling
settings, under the audio tag), checks the item's plan against its own checkpoint, decodes with PyAV and stores the
rows under the item's hash; every bad clip is its call's 400 with its own code, and the encoder serves on."""
from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from connector.tensors.producer import ECProducer
from encoder_service.config import EncoderConfig
from encoder_service.server import create_app
from encoder_service.worker import EncoderWorker
from epd_builders.audio_tiny import AudioTinySpec, build_audio_tiny
from epd_contracts.audio import AudioPart, audio_hash, part_hash
from epd_models.audio_jobs import audio_limits
from epd_models.halves import VisionHalf
from tests.audio_clips import hour_of_silence_flac, make_audio

CLIP = make_audio("wav", seconds=2.0, rate=16_000, channels=1)
RATE = AudioPart(sample_rate=16_000)


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> VisionHalf:
    root = tmp_path_factory.mktemp("audio-encode")
    return VisionHalf(build_audio_tiny(AudioTinySpec(family="qwen2_audio"), root / "qwen2_audio"))


@pytest.fixture
def client(vision: VisionHalf) -> Iterator[tuple[TestClient, EncoderWorker]]:
    cfg = EncoderConfig(insecure=True, max_audio_seconds=60.0)
    worker = EncoderWorker(vision, ECProducer().start(), audio_limits=audio_limits(cfg, cfg.max_encode_bytes))
    with TestClient(create_app(cfg, worker)) as c:
        yield c, worker


def item(data: bytes, part: AudioPart = RATE, **extra: Any) -> dict[str, Any]:
    return {"data": base64.b64encode(data).decode(), "audio": {k: v for k, v in (
        ("sample_rate", part.sample_rate), ("window", part.window), ("first", part.first), ("count", part.count))
        if v}, **extra}


def error(resp: Any) -> tuple[int, str, str]:
    body = resp.json()["error"]
    return resp.status_code, body["code"], body["param"]


def test_a_clip_is_encoded_and_stored_under_its_audio_hash(client: tuple[TestClient, EncoderWorker]) -> None:
    c, worker = client
    resp = c.post("/encode", json={"items": [item(CLIP, mm_hash=audio_hash(CLIP, RATE.config()))]})
    assert resp.status_code == 200, resp.text
    [out] = resp.json()["items"]
    assert out["mm_hash"] == part_hash(CLIP, RATE) and out["num_tokens"] == 50 and not out["cached"]
    stored = worker.producer.get_cache_item(out["mm_hash"])
    assert stored is not None and stored.num_tokens == 50
    again = c.post("/encode", json={"items": [item(CLIP)]}).json()["items"][0]
    assert again["cached"] and worker.num_encoded == 1
    assert c.get("/health").json()["model_identity"]["audio"] == {"sample_rate": 16_000, "window_seconds": 0.0,
                                                                  "max_seconds": 30.0, "in_video": False}


@pytest.mark.parametrize("data,part,code,field", [
    (CLIP, AudioPart(sample_rate=24_000), "audio_plan_mismatch", "data"),  # planned for another model's rate
    (CLIP, AudioPart(sample_rate=16_000, window=2.0), "audio_plan_mismatch", "data"),  # another model's window
    (CLIP, AudioPart(sample_rate=16_000, window=2.0, first=1, count=1), "audio_plan_mismatch", "data"),
    (CLIP[: len(CLIP) // 2] + b"\x00", RATE, "invalid_audio", "data"),  # a WAV cut short
    (b"RIFF\x00\x00\x00\x00WAVEnot audio", RATE, "invalid_audio", "data"),
    (hour_of_silence_flac(), RATE, "audio_too_large", "data"),  # an hour in a few KB: counted, refused
])
def test_bad_audio_items_are_their_calls_400(client: tuple[TestClient, EncoderWorker], data: bytes, part: AudioPart,
                                            code: str, field: str) -> None:
    c, worker = client
    resp = c.post("/encode", json={"items": [item(data, part)]})
    assert error(resp) == (400, code, f"items.0.{field}"), resp.text
    assert worker.num_encoded == 0
    assert c.post("/encode", json={"items": [item(CLIP)]}).status_code == 200  # it serves on


def test_a_hash_that_is_not_the_clips_is_refused(client: tuple[TestClient, EncoderWorker]) -> None:
    c, _ = client
    other = audio_hash(CLIP, AudioPart(sample_rate=24_000).config())  # the same bytes at another rate
    assert error(c.post("/encode", json={"items": [item(CLIP, mm_hash=other)]})) == (400, "hash_mismatch",
                                                                                     "items.0.mm_hash")


def test_an_audio_item_cannot_be_an_image_or_a_video_too(client: tuple[TestClient, EncoderWorker]) -> None:
    c, _ = client
    assert error(c.post("/encode", json={"items": [item(CLIP, detail="low")]})) == (400, "invalid_value", "items.0.audio")
    both = item(CLIP, video={"sampling": {"num_frames": 1, "fps": 1.0, "max_pixels": 1}, "count": 1, "total": 1})
    assert error(c.post("/encode", json={"items": [both]})) == (400, "invalid_value", "items.0.audio")


def test_an_image_encoder_refuses_audio_as_not_supported(tiny_model_dirs: dict[str, Path]) -> None:
    cfg = EncoderConfig(insecure=True)
    worker = EncoderWorker(VisionHalf(tiny_model_dirs["llava"]), ECProducer().start())
    with TestClient(create_app(cfg, worker)) as c:
        assert c.get("/health").json()["model_identity"]["audio"] is None
        assert error(c.post("/encode", json={"items": [item(CLIP)]})) == (400, "audio_not_supported", "items.0.data")
