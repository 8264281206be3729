"""epd-bench's videos: short H.264 MP4 clips made with PyAV (no torch), each one distinct by construction.

Clip (seed, video_id) shows a square moving left to right across a background, in colours drawn from (seed, id),
under a strip of black and white cells that spells the seed and the id in binary: two clips with a different
(seed, id) differ in pixels, so never in bytes, and a server's cache can never serve one for the other (a repeat
in the dataset sends the very same bytes on purpose). The frame count, size and rate are the caller's; H.264's
4:2:0 sampling needs an even width and height.
"""
from __future__ import annotations

import base64
import io
from fractions import Fraction
from typing import cast

import av
import numpy as np

ID_BITS = 32  # bits of the seed and of the id each that the strip writes
MIME = "video/mp4"


def check_clip_size(width: int, height: int) -> None:
    """ValueError unless H.264 with 4:2:0 chroma can hold a width x height frame (and the id strip fits)."""
    if width < 2 * ID_BITS or height < 16 or width % 2 or height % 2:
        raise ValueError(f"a video frame must be an even width >= {2 * ID_BITS} by an even height >= 16; "
                         f"got {width}x{height}")


def clip_frames(seed: int, video_id: int, num_frames: int, width: int, height: int) -> np.ndarray:
    """The clip's frames as (num_frames, height, width, 3) uint8 RGB."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, video_id & 0xFFFFFFFF])
    background, shape = rng.integers(0, 256, 3, dtype=np.uint8), rng.integers(0, 256, 3, dtype=np.uint8)
    frames = np.empty((num_frames, height, width, 3), np.uint8)
    frames[:] = background
    strip = max(2, height // 16)
    bits = [(seed >> b) & 1 for b in range(ID_BITS)] + [(video_id >> b) & 1 for b in range(ID_BITS)]
    cell = width // len(bits)
    for i, bit in enumerate(bits):
        frames[:, :strip, i * cell:(i + 1) * cell] = 255 if bit else 0
    side = max(2, min(width, height - strip) // 4)
    top = strip + (height - strip - side) // 2
    for f in range(num_frames):
        left = (width - side) * f // max(1, num_frames - 1)
        frames[f, top:top + side, left:left + side] = shape
    return frames


def make_clip(seed: int, video_id: int, num_frames: int, width: int, height: int, fps: float) -> bytes:
    """The clip as MP4 bytes (H.264, yuv420p, every frame kept)."""
    check_clip_size(width, height)
    if num_frames < 1 or not fps > 0:
        raise ValueError(f"a clip needs >= 1 frame and fps > 0; got {num_frames} frames at {fps}")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = cast(av.VideoStream, out.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000)))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.options = {"preset": "ultrafast"}
        for pixels in clip_frames(seed, video_id, num_frames, width, height):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def clip_data_url(seed: int, video_id: int, num_frames: int, width: int, height: int, fps: float) -> str:
    """make_clip(...) as a data: URL, the form a `video_url` content part carries."""
    data = make_clip(seed, video_id, num_frames, width, height, fps)
    return f"data:{MIME};base64,{base64.b64encode(data).decode()}"
