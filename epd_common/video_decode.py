"""The sampled frames of untrusted video bytes as RGB images: decoded from the keyframe before them, bounded.

`decode_frames` decodes only the runs of frames `epd_common/video_index.py` `decode_spans` gives: each run starts at
a keyframe (container.seek to its pts, backward, keyframes only) and frames are named by their pts, so frame i is
the i-th in presentation order, as decoding from the start counts them. Every run is checked as it is decoded:
its frames must come out as the index says (the run's first frame, then each next one). A stream that does not
(no usable pts, a seek that lands elsewhere) is decoded from its first frame instead, counting frames as they come,
as before seeking existed: the frames returned are the same either way.

Bounds, all VideoTooLargeError before or while decoding: the frames asked for (`max_frames`), their pixels after
resizing (`max_total_pixels`), the frames decoded to reach them (`max_decode_frames`: checked against the index's
plan before the first frame is decoded, and counted while decoding, fallback included), the frame size, and the
wall clock (`max_decode_s`).
"""
from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from PIL import Image

from epd_common.media_open import AV_ERRORS
from epd_common.video import (
    VideoError,
    VideoLimits,
    VideoTooLargeError,
    _open,
    _video_stream,
    check_frame_size,
    scan_frames,
)
from epd_common.video_index import FrameIndex, decode_cost, decode_spans


class _Astray(Exception):
    """A run's frames did not come out as the index says: decode from the start instead."""


class _Budget:
    """Frames decoded by one decode_frames call, fallback included (`max_decode_frames`), and its deadline."""

    def __init__(self, limits: VideoLimits) -> None:
        self.left, self.limit = limits.max_decode_frames, limits.max_decode_frames
        self.deadline = time.monotonic() + limits.max_decode_s
        self.num_decoded = 0

    def spend(self) -> None:
        self.num_decoded += 1
        self.left -= 1
        if self.left < 0:
            raise VideoTooLargeError(f"reaching the asked frames takes more than {self.limit} decoded frames")
        if time.monotonic() > self.deadline:
            raise VideoTooLargeError("video takes too long to decode")


def _fit(width: int, height: int, max_pixels: int | None) -> tuple[int, int]:
    """The size, aspect kept, at which a width x height frame has at most max_pixels (never upscaled)."""
    if max_pixels is None or width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def _check_wanted(indices: Sequence[int], limits: VideoLimits) -> None:
    if not indices:
        raise VideoError("no frame asked for")
    if len(indices) > limits.max_frames:
        raise VideoTooLargeError(f"{len(indices)} frames asked for; the limit is {limits.max_frames}")
    if min(indices) < 0 or max(indices) >= limits.max_scan_frames:
        raise VideoTooLargeError(f"frame indices must be in 0..{limits.max_scan_frames - 1}")


def _decoded(container: Any, stream: Any, limits: VideoLimits, budget: _Budget) -> Iterator[Any]:
    """The frames the decoder gives from where the container is, refusing corrupt data, oversized frames, overtime."""
    try:
        for frame in container.decode(stream):
            check_frame_size(frame.width, frame.height, limits.max_pixels_per_frame)  # the picture may change size
            budget.spend()
            yield frame
    except VideoError:
        raise
    except AV_ERRORS as exc:
        raise VideoError("corrupt video data") from exc


def _counted(container: Any, stream: Any, limits: VideoLimits, budget: _Budget) -> Iterator[tuple[int, Any]]:
    """(index, frame) from the first frame on, counting frames as they come."""
    yield from enumerate(_decoded(container, stream, limits, budget))


def _runs(container: Any, stream: Any, index: FrameIndex, spans: list[tuple[int, int]], limits: VideoLimits,
          budget: _Budget) -> Iterator[tuple[int, Any]]:
    """(index, frame) of each run of `spans`, each from its keyframe (a run from frame 0: no seek), named by pts."""
    position = index.position()
    for start, end in spans:
        if start:
            container.seek(index.pts[start], backward=True, any_frame=False, stream=stream)
        expected = start
        for frame in _decoded(container, stream, limits, budget):
            i = position.get(frame.pts, -1) if frame.pts is not None else -1
            if 0 <= i < start and expected == start:
                continue  # frames before the run's keyframe that the decoder still gives
            if i != expected:
                raise _Astray(f"frame {i} came where frame {expected} was due")
            yield i, frame
            if i == end:
                break
            expected += 1
        else:  # the decoder stopped before the run's last frame: the fallback says whether the video is short
            raise _Astray(f"the decoder stopped before frame {end}")


def _keep_wanted(frames: Iterator[tuple[int, Any]], wanted: Counter[int], max_pixels: int | None,
                 limits: VideoLimits) -> dict[int, Image.Image]:
    """Convert the wanted frames (index -> times asked for) to RGB, stopping after the last one."""
    kept: dict[int, Image.Image] = {}
    budget, last, seen = limits.max_total_pixels, max(wanted), 0
    for i, frame in frames:
        seen = i + 1
        if i in wanted:
            out_w, out_h = _fit(frame.width, frame.height, max_pixels)
            budget -= wanted[i] * out_w * out_h  # counted per frame: the picture may change size mid-stream
            if budget < 0:
                raise VideoTooLargeError(f"the frames asked for pass the limit of {limits.max_total_pixels} pixels")
            resized = (out_w, out_h) != (frame.width, frame.height)
            rgb = frame.to_ndarray(format="rgb24", width=out_w, height=out_h, interpolation="AREA" if resized else None)
            kept[i] = Image.fromarray(rgb)  # ~4x faster than frame.to_image()
        if i >= last:
            break
    if len(kept) < len(wanted):
        missing = min(set(wanted) - kept.keys())
        raise VideoError(f"video ended after {seen} frames; frame {missing} was asked for")
    return kept


def frame_index(data: bytes, limits: VideoLimits | None = None) -> FrameIndex:
    """The video's FrameIndex from a demux pass (probe_video's VideoInfo.index is the same)."""
    limits = limits or VideoLimits()
    with _open(data, limits) as container:
        return scan_frames(container, _video_stream(container, limits), limits)


def decode_frames(data: bytes, indices: Sequence[int], limits: VideoLimits | None = None,
                  max_pixels: int | None = None, index: FrameIndex | None = None) -> list[Image.Image]:
    """The frames at `indices` (presentation order, from 0) as RGB images, each downscaled (aspect kept) to at
    most `max_pixels` if given, decoded from the keyframes before them (the module docstring). `index`: the
    video's FrameIndex (probe_video's VideoInfo.index), else a demux pass finds it. Raises VideoError if the video
    ends before the last index, VideoTooLargeError past a limit."""
    limits = limits or VideoLimits()
    _check_wanted(indices, limits)
    if max_pixels is not None and max_pixels < 1:
        raise VideoError(f"max_pixels must be >= 1, got {max_pixels}")
    index = index or frame_index(data, limits)
    spans = decode_spans(indices, index.keyframes)
    cost = decode_cost(indices, index.keyframes)
    if cost > limits.max_decode_frames:
        raise VideoTooLargeError(f"reaching the asked frames takes {cost} decoded frames from the video's "
                                 f"keyframes; the limit is {limits.max_decode_frames}")
    budget = _Budget(limits)
    try:
        return _decode(data, indices, limits, max_pixels, budget, index, spans)
    except _Astray:
        return _decode(data, indices, limits, max_pixels, budget, None, [])


def _decode(data: bytes, indices: Sequence[int], limits: VideoLimits, max_pixels: int | None, budget: _Budget,
            index: FrameIndex | None, spans: list[tuple[int, int]]) -> list[Image.Image]:
    """One decoding pass: the runs of `spans` by `index`, or (index None) every frame from the first."""
    with _open(data, limits) as container:
        stream = _video_stream(container, limits)
        ctx = stream.codec_context
        out_w, out_h = _fit(ctx.width, ctx.height, max_pixels)
        if len(indices) * out_w * out_h > limits.max_total_pixels:
            raise VideoTooLargeError(f"{len(indices)} frames of {out_w}x{out_h} pixels pass the limit of "
                                     f"{limits.max_total_pixels} pixels in all")
        ctx.thread_count = limits.num_threads
        ctx.options = {"max_pixels": str(limits.max_pixels_per_frame)}
        frames = (_runs(container, stream, index, spans, limits, budget) if index is not None and index.seekable
                  else _counted(container, stream, limits, budget))
        kept = _keep_wanted(frames, Counter(indices), max_pixels, limits)
    return [kept[i] for i in indices]
