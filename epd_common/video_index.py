"""Where a video's keyframes are, and which frames must be decoded to reach the sampled ones (no decoding here).

A decoder can only start at a keyframe. `decode_spans` says, for the frames a chunk wants, which runs of frames
are decoded: each wanted frame from the last keyframe at or before it, unless the run already being decoded
reaches it first. `decode_cost` is their length: what the proxy budgets per request (--max-video-decode-frames)
and what an encoder checks per chunk before it decodes anything, from the same index, so both count alike.

The index comes from a demux pass (packets, no decoding): frame i in presentation order is the packet of the
i-th smallest pts, the order frames come out of the decoder (what decode_frames counts by). A stream whose
packets lack a pts or repeat one has no usable index: `keyframes` is (0,) and every run starts at frame 0,
the cost of decoding from the start, which is what decode_frames then does.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FrameIndex:
    """The video's frames in presentation order: their pts (empty: unknown), and which are keyframes."""

    num_frames: int  # the video stream's packets (one a frame)
    pts: tuple[int, ...]  # pts of frame i, ascending (stream time_base units); () when not usable
    keyframes: tuple[int, ...]  # frame indices a decode may start at, ascending; always starts with 0

    @property
    def seekable(self) -> bool:
        return bool(self.pts)

    def position(self) -> dict[int, int]:
        """pts -> frame index."""
        return {p: i for i, p in enumerate(self.pts)}


def build_index(packets: Iterable[tuple[int | None, bool]]) -> FrameIndex:
    """From each frame's packet (pts, is_keyframe), in any order."""
    listed = list(packets)
    pts = [p for p, _ in listed]
    if not listed or any(p is None for p in pts) or len(set(pts)) != len(pts):
        return FrameIndex(len(listed), (), (0,))
    order = sorted(p for p in pts if p is not None)
    rank = {p: i for i, p in enumerate(order)}
    keys = {rank[p] for p, key in listed if key and p is not None}
    return FrameIndex(len(listed), tuple(order), tuple(sorted(keys | {0})))


def decode_spans(wanted: Iterable[int], keyframes: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end] (inclusive) runs of frames to decode for the `wanted` frame indices: a run starts at the last
    keyframe at or before a wanted frame unless the run before already reaches that keyframe."""
    spans: list[tuple[int, int]] = []
    for w in sorted(set(wanted)):
        key = keyframes[max(0, bisect.bisect_right(keyframes, w) - 1)] if keyframes else 0
        if spans and key <= spans[-1][1]:
            spans[-1] = (spans[-1][0], w)
        else:
            spans.append((min(key, w), w))
    return spans


def decode_cost(wanted: Iterable[int], keyframes: Sequence[int]) -> int:
    """Frames decoded to reach the `wanted` frames (the runs of `decode_spans`)."""
    return sum(end - start + 1 for start, end in decode_spans(wanted, keyframes))
