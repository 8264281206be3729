"""An encoder batches images of different requests into one vision forward (encoder_service/encode_scheduler.py)
only where that changes nothing: for every family that says it batches exactly, a batch of two images of two sizes
gives each image's features bit for bit as encoding it alone (rows, DeepStack rows, span, grid); the family that
does not (Qwen3-VL) says so, and the scheduler then runs each image alone. Its vision-token count (the batch budget's
unit) is the processor's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder_service.aggregated import InlineCache
from epd_builders.tiny import FAMILIES
from epd_models.encode import CachingEncoder, ImageJob
from epd_models.halves import VisionHalf
from epd_models.video import VIDEO_FAMILIES
from tests.factories import make_image

SIZES = ((224, 224), (320, 200))


def fresh(vision: VisionHalf) -> CachingEncoder:
    return CachingEncoder(vision, InlineCache(1 << 30))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_two_sizes_equals_each_image_alone(tiny_model_dirs: dict[str, Path], family: str) -> None:
    vision = VisionHalf(tiny_model_dirs[family])
    colors = ("red", "blue")
    jobs = [ImageJob(f"img{i}", make_image(w, h, colors[i])) for i, (w, h) in enumerate(SIZES)]
    batched = fresh(vision).run(jobs)
    alone = {j.mm_hash: fresh(vision).run([j])[j.mm_hash] for j in jobs}
    same = []
    for j in jobs:
        a, b = batched[j.mm_hash].features, alone[j.mm_hash].features
        same.append(torch.equal(a.embeds, b.embeds) and a.span == b.span and a.grid_thw == b.grid_thw
                    and (a.deepstack is None) == (b.deepstack is None)
                    and (a.deepstack is None or torch.equal(a.deepstack, b.deepstack)))
        assert vision.image_tokens(j.image.size) >= 1
    if vision.batches_exactly:
        assert all(same), family
    else:  # the scheduler keeps such a family's images apart; the test shows why it must
        assert family in ("qwen3_vl", "qwen3_vl_moe") and not all(same)


@pytest.mark.parametrize("family", [f for f in VIDEO_FAMILIES if f in FAMILIES])  # Omni's: test_audio_omni.py
def test_video_parts_of_different_requests_in_one_batch_equal_each_alone(
        tiny_model_dirs: dict[str, Path], family: str) -> None:
    """Two videos of other frame sizes and lengths, and two chunks of a third, batched as the scheduler batches
    video parts: each part's features bit for bit as encoding it alone."""
    vision = VisionHalf(tiny_model_dirs[family])
    colors = ("red", "green", "blue", "yellow")
    short = [make_image(168, 112, c) for c in colors[:2]]
    other = [make_image(112, 168, c, "square") for c in colors]  # other size (LLaVA-OneVision resizes anyway)
    whole = [make_image(168, 112, c, "square") for c in colors]
    times = [i / 3.0 for i in range(4)]
    clips = [vision.video_clip(short, 3.0), vision.video_clip(other, 3.0),
             vision.video_clip(whole[:2], 3.0, frame_times=times[:2], last=False, total_frames=4),
             vision.video_clip(whole[2:], 3.0, frame_times=times[2:], last=True, total_frames=4)]
    batched = vision.encode_videos(clips)
    alone = [vision.encode_videos([clip])[0] for clip in clips]
    for a, b in zip(batched, alone, strict=True):
        assert torch.equal(a.embeds, b.embeds) and a.grid_thw == b.grid_thw and a.span == b.span
        assert a.second_per_grid_t == b.second_per_grid_t
        assert (a.deepstack is None) == (b.deepstack is None)
        assert a.deepstack is None or torch.equal(a.deepstack, b.deepstack)
