"""/encode of videos (epd_contracts/video.py): each item is a chunk of a video's sampled frames, hashed by the
encoder itself, checked against the encoder's own sampling of the bytes, and stored under the chunk's hash; the
chunks of one video encoded on two encoders are the whole video's rows; every bad video is its call's 400."""
from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from connector.tensors.producer import ECProducer
from encoder_service.cli import parse_args
from encoder_service.config import EncoderConfig
from encoder_service.server import create_app
from encoder_service.worker import EncoderWorker
from epd_common.video import VideoLimits, probe_video
from epd_common.video_sampling import VideoConfig, frame_indices
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.video import VideoPart, VideoSampling, part_hash
from epd_models import video_jobs
from epd_models.halves import VisionHalf
from epd_models.video import VideoClip
from epd_models.video_config import video_config, video_limits
from tests.encoder_service.video_plan import PlannedVideo, plan_video
from tests.factories import frame_number, make_video

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision")
VIDEO = make_video(num_frames=12, width=96, height=48, fps=10)  # frame i: a red square at x = 4 * i
NUM_FRAMES = 9  # the request's frame count: Qwen2 rounds it to 8 (2 chunks); Qwen3 and OneVision: 4 + 4 + 1
PER_CHUNK = 4


@pytest.fixture(scope="module")
def visions(tiny_model_dirs: dict[str, Path]) -> dict[str, VisionHalf]:
    return {family: VisionHalf(tiny_model_dirs[family]) for family in FAMILIES}


class Encoders:
    """Encoder apps over one vision half, each with its own producer (what two encoder processes hold)."""

    def __init__(self, vision: VisionHalf, cfg: EncoderConfig, count: int):
        self.workers = [EncoderWorker(vision, ECProducer().start(), video_limits=video_limits(cfg, cfg.max_encode_bytes))
                        for _ in range(count)]
        self.clients = [TestClient(create_app(cfg, w)) for w in self.workers]

    def __enter__(self) -> Encoders:
        for c in self.clients:
            c.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for c in self.clients:  # each app closes its producer at shutdown
            c.__exit__(None, None, None)


def encoders(vision: VisionHalf, count: int = 1, **cfg: Any) -> Encoders:
    return Encoders(vision, EncoderConfig(insecure=True, **cfg), count)


@pytest.fixture
def one(visions: dict[str, VisionHalf]) -> Iterator[tuple[TestClient, EncoderWorker]]:
    with encoders(visions["qwen2_vl"]) as e:
        yield e.clients[0], e.workers[0]


def planned(vision: VisionHalf, num_frames: int | None = NUM_FRAMES) -> PlannedVideo:
    config = video_config(vision.model_dir, vision.adapter.name)
    assert config is not None
    return plan_video(VIDEO, config, PER_CHUNK, num_frames)


def error(resp: Any) -> tuple[int, str, str]:
    body = resp.json()["error"]
    return resp.status_code, body["code"], body["param"]


@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_on_two_encoders_are_the_whole_video_row_for_row(visions: dict[str, VisionHalf], family: str) -> None:
    """Chunk k goes to encoder k % 2; their rows, DeepStack rows and spans, concatenated, equal the whole video
    encoded at once by a third. Compared with a tight tolerance, not torch.equal: a chunk runs the same per-patch
    math on fewer rows (the Qwen towers attend within one temporal patch; OneVision and Qwen3-VL's frames are
    independent too), but float32 matmuls over another number of rows may round differently (seen: up to 7e-8
    on Qwen2-VL / Qwen2.5-VL; Qwen3-VL and OneVision come out bitwise equal)."""
    vision = visions[family]
    plan = planned(vision)
    assert len(plan.chunks) >= 2
    with encoders(vision, 3) as e:
        items = []
        for k, chunk in enumerate(plan.chunks):
            resp = e.clients[k % 2].post("/encode", json={"items": [plan.item(chunk)]})
            assert resp.status_code == 200, resp.text
            [item] = resp.json()["items"]
            assert item["mm_hash"] == chunk.mm_hash and not item["cached"]
            items.append(item)
        parts = [e.workers[k % 2].producer.get_cache_item(c.mm_hash) for k, c in enumerate(plan.chunks)]
        resp = e.clients[2].post("/encode", json={"items": [plan.item()]})
        assert resp.status_code == 200, resp.text
        whole = e.workers[2].producer.get_cache_item(plan.mm_hash)
    assert whole is not None and all(p is not None for p in parts)
    chunks: list[ImageFeatures] = [p for p in parts if p is not None]
    assert resp.json()["items"][0]["num_tokens"] == whole.num_tokens == sum(i["num_tokens"] for i in items)
    assert all(c.is_video and c.second_per_grid_t == whole.second_per_grid_t for c in chunks)
    torch.testing.assert_close(torch.cat([c.embeds for c in chunks]), whole.embeds, rtol=1e-5, atol=1e-6)
    if whole.grid_thw is not None:
        assert whole.grid_thw == (sum(c.grid_thw[0] for c in chunks if c.grid_thw), *chunks[0].grid_thw[1:])  # type: ignore[index]
    if whole.span is not None:
        assert whole.span == tuple(t for c in chunks for t in c.span or ())
    if whole.deepstack is not None:
        torch.testing.assert_close(torch.cat([c.deepstack for c in chunks if c.deepstack is not None], dim=1),
                                   whole.deepstack, rtol=1e-5, atol=1e-6)


def test_each_chunk_decodes_its_planned_frames(one: tuple[TestClient, EncoderWorker],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The frames, times, end flag and video length the vision half gets are the plan's, chunk by chunk."""
    c, w = one
    plan = planned(w.vision, num_frames=None)  # the checkpoint's default: every frame (Qwen2VLVideoProcessor)
    config = w.video_config
    assert config is not None
    seen: list[dict[str, Any]] = []
    real = w.vision.video_clip

    def spy(frames: list[Any], fps: float, *args: Any, **kwargs: Any) -> VideoClip:
        seen.append({"frames": [frame_number(f) for f in frames], "fps": fps, **kwargs})
        return real(frames, fps, *args, **kwargs)

    monkeypatch.setattr(w.vision, "video_clip", spy)
    resp = c.post("/encode", json={"items": [plan.item(chunk) for chunk in plan.chunks]})
    assert resp.status_code == 200, resp.text
    info = probe_video(VIDEO)
    indices = frame_indices(config, info, plan.sampling.num_frames)
    assert len(indices) == plan.total == 12 and len(plan.chunks) == 3
    for chunk, got in zip(plan.chunks, seen, strict=True):
        want = indices[chunk.first : chunk.first + chunk.count]
        assert got["frames"] == want and got["fps"] == plan.sampling.fps
        assert got["frame_times"] == [i / info.fps for i in want]
        assert got["last"] == (chunk is plan.chunks[-1]) and got["total_frames"] == plan.total


def test_a_forged_hash_is_refused_and_nothing_is_stored(one: tuple[TestClient, EncoderWorker]) -> None:
    c, w = one
    plan = planned(w.vision)
    first, second = plan.chunks[:2]
    resp = c.post("/encode", json={"items": [plan.item(first, mm_hash=second.mm_hash)]})
    assert error(resp) == (400, "hash_mismatch", "items.0.mm_hash")
    low = {**plan.item(first), "detail": "low"}
    assert error(c.post("/encode", json={"items": [low]}))[0:1] == (400,)
    assert not w.producer.has_cache_item(second.mm_hash) and not w.producer.has_cache_item(first.mm_hash)
    assert w.num_encoded == 0


def _item(plan: PlannedVideo, part: VideoPart) -> dict[str, Any]:
    """An item for `part` under its true hash (so only the plan check can refuse it)."""
    s = part.sampling
    return {"mm_hash": part_hash(plan.data, part), "data": base64.b64encode(plan.data).decode(),
            "video": {"sampling": {"num_frames": s.num_frames, "fps": s.fps, "max_pixels": s.max_pixels},
                      "first": part.first, "count": part.count, "total": part.total}}


def test_a_plan_the_encoder_does_not_share_is_a_400(one: tuple[TestClient, EncoderWorker]) -> None:
    c, w = one
    plan = planned(w.vision)
    s = plan.sampling
    bad = {
        "another total": VideoPart(sampling=s, first=0, count=4, total=plan.total + 2),
        "another fps": VideoPart(sampling=VideoSampling(num_frames=s.num_frames, fps=s.fps * 1.001,
                                                        max_pixels=s.max_pixels), first=0, count=4, total=plan.total),
        "half a temporal patch": VideoPart(sampling=s, first=1, count=2, total=plan.total),
        "more frames than the video": VideoPart(sampling=VideoSampling(num_frames=40, fps=s.fps,
                                                                       max_pixels=s.max_pixels),
                                                first=0, count=4, total=40),
    }
    for why, part in bad.items():
        resp = c.post("/encode", json={"items": [_item(plan, part)]})
        assert error(resp) == (400, "video_plan_mismatch", "items.0.data"), (why, resp.text)
    assert w.num_encoded == 0
    # the last chunk may end short of a whole temporal patch: frames [6, 8) of 8 is fine, [7, 8) is not
    assert c.post("/encode", json={"items": [_item(plan, VideoPart(sampling=s, first=6, count=2,
                                                                   total=plan.total))]}).status_code == 200
    assert error(c.post("/encode", json={"items": [_item(plan, VideoPart(sampling=s, first=7, count=1,
                                                                         total=plan.total))]}))[1] == "video_plan_mismatch"


def test_a_bad_video_fails_only_its_call(one: tuple[TestClient, EncoderWorker],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    c, w = one
    plan = planned(w.vision)
    failed: list[str] = []
    monkeypatch.setattr(w.producer, "mark_failed", failed.extend)
    for data in (b"not a video", VIDEO[: len(VIDEO) // 2]):
        broken = PlannedVideo(data, plan.sampling, "", plan.total, plan.chunks)
        part = broken.part(plan.chunks[1])
        resp = c.post("/encode", json={"items": [plan.item(plan.chunks[0]), _item(broken, part)]})
        assert error(resp) == (400, "invalid_video", "items.1.data"), resp.text
        assert failed[-2:] == [plan.chunks[0].mm_hash, part_hash(data, part)]  # gets waiting for them answer now
    assert w.num_encoded == 0 and not w.producer.has_cache_item(plan.chunks[0].mm_hash)
    resp = c.post("/encode", json={"items": [plan.item(plan.chunks[0])]})
    assert resp.status_code == 200 and w.producer.has_cache_item(plan.chunks[0].mm_hash)


def test_a_vision_error_is_a_500_of_that_call(one: tuple[TestClient, EncoderWorker],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    c, w = one
    plan = planned(w.vision)
    failed: list[str] = []
    monkeypatch.setattr(w.producer, "mark_failed", failed.extend)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA error: device-side assert")

    monkeypatch.setattr(w.vision, "encode_videos", broken)
    assert error(c.post("/encode", json={"items": [plan.item(plan.chunks[0])]}))[0:2] == (500, "encode_failed")
    assert failed == [plan.chunks[0].mm_hash]


@pytest.mark.parametrize(("limits", "why"), [({"max_video_frames": 4}, "sampled frames"),
                                             ({"max_video_duration": 0.5}, "lasts"),
                                             ({"max_video_frame_pixels": 96 * 48 - 1}, "pixels")])
def test_the_video_limits_are_400s(visions: dict[str, VisionHalf], limits: dict[str, Any], why: str) -> None:
    vision = visions["qwen2_vl"]
    plan = planned(vision)
    with encoders(vision, **limits) as e:
        resp = e.clients[0].post("/encode", json={"items": [plan.item(plan.chunks[0])]})
        assert error(resp) == (400, "video_too_large", "items.0.data") and why in resp.json()["error"]["message"]
        assert e.workers[0].num_encoded == 0


def test_the_video_limit_flags() -> None:
    cfg = parse_args(["--insecure", "--max-video-duration", "30", "--max-video-frames", "64",
                      "--max-video-frame-pixels", "1000000", "--max-encode-bytes", "1234567"])
    assert video_limits(cfg, cfg.max_encode_bytes) == VideoLimits(max_bytes=1234567, max_duration_s=30.0,
                                                                  max_frames=64, max_pixels_per_frame=1_000_000)
    assert video_limits(EncoderConfig(), 1) == VideoLimits(max_bytes=1)  # the defaults are VideoLimits'


def test_a_held_chunk_is_not_decoded_or_encoded_again(one: tuple[TestClient, EncoderWorker],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    c, w = one
    plan = planned(w.vision)
    decoded: list[list[int]] = []
    real = video_jobs.decode_frames

    def counted(data: bytes, indices: list[int], *args: Any, **kwargs: Any) -> Any:
        decoded.append(list(indices))
        return real(data, indices, *args, **kwargs)

    monkeypatch.setattr(video_jobs, "decode_frames", counted)
    first, second = plan.chunks[:2]
    assert not c.post("/encode", json={"items": [plan.item(first)]}).json()["items"][0]["cached"]
    resp = c.post("/encode", json={"items": [plan.item(first), plan.item(second)]})
    assert [i["cached"] for i in resp.json()["items"]] == [True, False]
    assert w.num_encoded == 2 and len(decoded) == 2  # the held chunk was neither decoded nor encoded again


def test_a_model_without_video_refuses_videos_and_says_so_in_health(tiny_model_dirs: dict[str, Path],
                                                                    visions: dict[str, VisionHalf]) -> None:
    plan = planned(visions["qwen2_vl"])
    with encoders(VisionHalf(tiny_model_dirs["llava"])) as e:
        assert e.clients[0].get("/health").json()["model_identity"]["video"] is None
        resp = e.clients[0].post("/encode", json={"items": [plan.item(plan.chunks[0])]})
        assert error(resp) == (400, "video_not_supported", "items.0.data")


def test_health_reports_the_video_config(one: tuple[TestClient, EncoderWorker]) -> None:
    c, w = one
    reported = c.get("/health").json()["model_identity"]["video"]
    assert VideoConfig.from_dict(reported) == w.video_config == video_config(w.vision.model_dir, "qwen2_vl")
