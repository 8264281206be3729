"""The proxy's token count of a video (epd_common/video_tokens.py) is what the encoders return, for every family
that takes video, whole or in chunks, at the checkpoint's pixel budget and a request's lower one; its resizes are
transformers' own."""
from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_smart_resize_video

from connector.tensors.producer import ECProducer
from encoder_service.worker import EncoderWorker, ScheduledEncoderInput
from epd_common.video import VideoError, probe_video
from epd_common.video_sampling import VideoConfig, frame_indices, sampled_fps, target_frames
from epd_common.video_tokens import smart_resize, smart_resize_video, video_rows
from epd_contracts.video import VideoPart, VideoSampling, part_hash, plan_chunks
from epd_models.halves import VisionHalf
from epd_models.video_config import video_config
from tests.factories import make_video

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision")
CLIPS = {"wide": make_video(12, width=96, height=48, fps=10), "tall": make_video(9, width=32, height=160, fps=10)}


@pytest.fixture(scope="module", params=FAMILIES)
def worker(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, Path]) -> Iterator[EncoderWorker]:
    w = EncoderWorker(VisionHalf(tiny_model_dirs[request.param]), ECProducer().start())
    yield w
    w.producer.close()


def encoded_rows(w: EncoderWorker, data: bytes, config: VideoConfig, per_chunk: int, max_pixels: int) -> int:
    info = probe_video(data)
    n = target_frames(config, info)
    total = len(frame_indices(config, info, n))
    sampling = VideoSampling(num_frames=n, fps=sampled_fps(info, total), max_pixels=max_pixels)
    parts = [VideoPart(sampling=sampling, first=c.first, count=c.count, total=total)
             for c in plan_chunks("v", total, config.temporal_patch, per_chunk)]
    items = [ScheduledEncoderInput(part_hash(data, p), data, video=p) for p in parts]
    return sum(d.num_tokens for d in w.execute_mm_encoder(items))


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("per_chunk", [4, 64])
@pytest.mark.parametrize("budget", ["checkpoint", "low"])
def test_the_planned_rows_are_the_encoded_rows(worker: EncoderWorker, clip: str, per_chunk: int, budget: str) -> None:
    config = video_config(worker.vision.model_dir, worker.vision.adapter.name)
    assert config is not None
    data = CLIPS[clip]
    info = probe_video(data)
    max_pixels = config.max_pixels if budget == "checkpoint" else config.min_pixels
    total = len(frame_indices(config, info, target_frames(config, info)))
    planned = video_rows(config, info.width, info.height, total, max_pixels)
    assert planned is not None and planned > 0
    assert planned == encoded_rows(worker, data, config, per_chunk, max_pixels)


def test_a_config_without_the_token_rule_counts_nothing() -> None:
    old = VideoConfig(sampler="qwen2", temporal_patch=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    assert video_rows(old, 640, 480, 8, old.max_pixels) is None
    assert video_rows(VideoConfig(sampler="uniform", temporal_patch=1, min_pixels=1, max_pixels=1), 9, 9, 3, 1) is None


def agree(ours: Any, theirs: Any, *args: int) -> None:
    """`ours(*args)` is `theirs(*args)`, or a VideoError where transformers raises."""
    try:
        expected = theirs(*args)
    except (ValueError, ZeroDivisionError):
        with pytest.raises(VideoError):
            ours(*args)
        return
    assert ours(*args) == expected, args


def test_the_resizes_are_transformers_own() -> None:
    rng = random.Random(5)
    for _ in range(3000):
        h, w = rng.randint(1, 4000), rng.randint(1, 4000)
        factor = rng.choice([28, 32, 16])
        least = rng.choice([56 * 56, 128 * 28 * 28, 4096])
        most = rng.choice([least, 28 * 28 * 768, 1 << 20, 16 * 32 * 32 * 768])
        agree(smart_resize, lambda *a: hf_smart_resize(*a[:2], factor=a[2], min_pixels=a[3], max_pixels=a[4]),
              h, w, factor, least, most)
        agree(smart_resize_video, lambda *a: hf_smart_resize_video(*a[:3], temporal_factor=a[3], factor=a[4],
                                                                   min_pixels=a[5], max_pixels=a[6]),
              rng.randint(2, 300), h, w, 2, factor, least, most)
