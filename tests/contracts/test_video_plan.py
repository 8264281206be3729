"""A video's hash names its bytes and sampling; its chunks are whole temporal patches, in order, named apart."""
from __future__ import annotations

import msgspec
import pytest

from epd_contracts.hashing import mm_hash
from epd_contracts.video import VideoPart, VideoSampling, part_hash, plan_chunks, video_hash

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


def test_the_last_chunk_may_end_short_of_a_patch() -> None:
    assert [(c.first, c.count) for c in plan_chunks("v", 7, 2, 4)] == [(0, 4), (4, 3)]
    assert [(c.first, c.count) for c in plan_chunks("v", 1, 2, 8)] == [(0, 1)]


@pytest.mark.parametrize("frames,patch", [(0, 2), (4, 0), (-1, 1)])
def test_nothing_to_plan_is_refused(frames: int, patch: int) -> None:
    with pytest.raises(ValueError):
        plan_chunks("v", frames, patch, 8)


def test_a_part_names_its_chunk_and_a_whole_part_the_video() -> None:
    whole = VideoPart(sampling=SAMPLING, count=32, total=32)
    assert part_hash(b"clip", whole) == video_hash(b"clip", SAMPLING)
    chunks = plan_chunks(video_hash(b"clip", SAMPLING), 32, 2, 16)
    assert [part_hash(b"clip", VideoPart(sampling=SAMPLING, first=c.first, count=c.count, total=32))
            for c in chunks] == [c.mm_hash for c in chunks]
    assert VideoPart(sampling=SAMPLING, first=16, count=16, total=32).last


@pytest.mark.parametrize("body", [
    b'{"sampling":[4,2.0,100],"first":30,"count":4,"total":32}',  # past the end
    b'{"sampling":[0,2.0,100],"count":1,"total":1}',  # no frame
    b'{"sampling":[4,0.0,100],"count":1,"total":1}',  # fps 0
    b'{"sampling":[4,2.0,100],"count":1,"total":1,"extra":1}',
])
def test_a_bad_part_is_refused_on_decode(body: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(body, type=VideoPart)
