"""decode_frames decodes a chunk from the keyframe before its frames, not from the file's start, and within
--max-video-decode-frames (VideoLimits.max_decode_frames), counted before and while decoding: what one video
request costs an encoder is bounded by its sampled frames and the file's keyframe interval, not by its length.

Counts are of frames handed out by the decoder (`_Budget.spend`), never of time."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from epd_common import video_decode
from epd_common.video import VideoLimits, VideoTooLargeError, probe_video
from epd_common.video_decode import decode_frames
from epd_common.video_index import FrameIndex, decode_cost, decode_spans
from tests.hostile.video_clips import frame_id, gop_clip

CLIP = gop_clip(300, gop=25)  # 10 s at 30 fps, keyframes at 0, 25, 50, ...
CODECS = [("libx264", "mp4", {}), ("libx264", "mp4", {"bf": "3", "preset": "medium"}), ("libx264", "matroska", {}),
          ("libx265", "mp4", {}), ("libvpx-vp9", "webm", {}), ("mpeg4", "avi", {}), ("mjpeg", "mov", {})]


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """One entry per frame the decoder hands out, in any decode_frames call of the test."""
    counted: list[int] = []
    spend = video_decode._Budget.spend

    def counting(self: video_decode._Budget) -> None:
        counted.append(1)
        spend(self)

    monkeypatch.setattr(video_decode._Budget, "spend", counting)
    yield counted


def sequential(data: bytes, indices: list[int]) -> list[np.ndarray]:
    """The frames as a decode from the first frame gives them (an index without pts: no seek)."""
    n = probe_video(data).num_frames
    return [np.asarray(f) for f in decode_frames(data, indices, index=FrameIndex(n, (), (0,)))]


def test_a_chunk_at_the_end_is_decoded_from_its_keyframe(decoded: list[int]) -> None:
    frames = decode_frames(CLIP, [260, 270, 280])
    assert [frame_id(f) for f in frames] == [260, 270, 280]
    assert len(decoded) == (270 - 250 + 1) + (280 - 275 + 1)  # 250..270, then 275..280; not 0..280 (281 frames)


def test_frames_far_apart_are_each_reached_from_their_own_keyframe(decoded: list[int]) -> None:
    frames = decode_frames(CLIP, [10, 110, 290])
    assert [frame_id(f) for f in frames] == [10, 110, 290]
    assert len(decoded) == (10 + 1) + (110 - 100 + 1) + (290 - 275 + 1)
    assert decode_cost([10, 110, 290], probe_video(CLIP).keyframes) == len(decoded)


@pytest.mark.parametrize(("codec", "container", "options"), CODECS, ids=[f"{c}-{m}-{len(o)}" for c, m, o in CODECS])
def test_seeking_gives_the_frames_a_decode_from_the_start_gives(codec: str, container: str,
                                                                 options: dict[str, str]) -> None:
    data = gop_clip(120, gop=10, codec=codec, container=container, options=options)
    wanted = [3, 37, 38, 64, 64, 99, 119, 50]  # repeats and any order, as samplers ask
    got = decode_frames(data, wanted)
    assert [frame_id(f) for f in got] == wanted
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(got, sequential(data, wanted), strict=True))


def test_the_budget_refuses_before_any_frame_is_decoded(decoded: list[int]) -> None:
    one_keyframe = gop_clip(300, gop=1000)  # near-still clips are often one keyframe and P-frames
    assert probe_video(one_keyframe).keyframes == (0,)
    with pytest.raises(VideoTooLargeError, match="takes 281 decoded frames .* the limit is 280"):
        decode_frames(one_keyframe, [260, 280], VideoLimits(max_decode_frames=280))
    assert decoded == []
    assert [frame_id(f) for f in decode_frames(one_keyframe, [280], VideoLimits(max_decode_frames=281))] == [280]


def test_a_run_that_goes_astray_falls_back_to_the_start_within_the_same_budget(decoded: list[int]) -> None:
    real = probe_video(CLIP).index
    forged = FrameIndex(real.num_frames, tuple(p + 1 for p in real.pts), real.keyframes)  # no frame has these pts
    assert [frame_id(f) for f in decode_frames(CLIP, [260], index=forged)] == [260]
    assert len(decoded) == 1 + 261  # the run's first frame, seen astray, then every frame from the start
    decoded.clear()
    with pytest.raises(VideoTooLargeError, match="more than 100 decoded frames"):
        decode_frames(CLIP, [260], VideoLimits(max_decode_frames=100), index=forged)
    assert len(decoded) == 101


def test_the_spans_start_at_the_last_keyframe_and_continue_a_run_that_reaches_it() -> None:
    keys = (0, 25, 50, 75)
    assert decode_spans([60, 30, 70, 80], keys) == [(25, 30), (50, 70), (75, 80)]
    assert decode_spans([26, 27, 51], keys) == [(25, 27), (50, 51)]
    assert decode_spans([5, 40], (0,)) == [(0, 40)]  # no usable index: one run from the start
