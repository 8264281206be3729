"""A video's hash names its bytes and sampling; its chunks are whole temporal patches, in order, named apart."""
from __future__ import annotations

import pytest

from epd_contracts.hashing import mm_hash
from epd_contracts.video import VideoSampling, plan_chunks, video_hash

SAMPLING = VideoSampling(num_frames=32, fps=2.0, max_pixels=200_000)


def test_the_hash_names_the_bytes_and_the_sampling_and_never_an_image() -> None:
    h = video_hash(b"clip", SAMPLING)
    assert len(h) == 64 and h == video_hash(b"clip", SAMPLING)
    others = {video_hash(b"clip2", SAMPLING), video_hash(b"clip", VideoSampling(32, 1.0, 200_000)),
              video_hash(b"clip", VideoSampling(16, 2.0, 200_000)), video_hash(b"clip", VideoSampling(32, 2.0, 1)),
              mm_hash(b"clip")}
    assert h not in others and len(others) == 5


def test_chunks_cover_every_frame_once_in_whole_patches() -> None:
    chunks = plan_chunks("v", 32, temporal_patch=2, frames_per_chunk=9)  # rounded down to 8 frames (4 patches)
    assert [(c.first, c.count) for c in chunks] == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert len({c.mm_hash for c in chunks} | {"v"}) == 5  # each named apart, none the video's own
    assert [(c.first, c.count) for c in plan_chunks("v", 10, 2, 4)] == [(0, 4), (4, 4), (8, 2)]
    assert plan_chunks("v", 32, 2, 64) == plan_chunks("v", 32, 2, 32) and plan_chunks("v", 32, 2, 32)[0].mm_hash == "v"
    assert [c.count for c in plan_chunks("v", 6, 2, 1)] == [2, 2, 2]  # at least one patch per chunk


@pytest.mark.parametrize("frames,patch", [(0, 2), (7, 2), (4, 0), (1, 2)])
def test_frames_that_are_not_whole_patches_are_refused(frames: int, patch: int) -> None:
    with pytest.raises(ValueError):
        plan_chunks("v", frames, patch, 8)
