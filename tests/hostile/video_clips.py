"""Clips with a chosen keyframe interval (GOP), built with PyAV, whose frames say their own index (`frame_id`)."""
from __future__ import annotations

import io
from typing import Any, cast

import av
import numpy as np
from PIL import Image

from tests.factories import ordinary_scheduling

BITS = 12  # frame index bits drawn as blocks: up to 4,096 frames
BLOCK = 8  # pixels a block side


def gop_clip(num_frames: int, gop: int, codec: str = "libx264", container: str = "mp4", fps: int = 30,
             options: dict[str, str] | None = None) -> bytes:
    """A 96x48 clip whose keyframes come every `gop` frames (one only, for gop >= num_frames); frame i shows i in
    binary as white blocks on black (top row) over a still grey picture."""
    buf = io.BytesIO()
    with ordinary_scheduling(), av.open(buf, "w", format=container) as out:  # tests/factories.py says why
        stream = cast(av.VideoStream, out.add_stream(codec, rate=fps))
        stream.width, stream.height = BITS * BLOCK, 48
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        stream.codec_context.gop_size = gop
        opts: dict[str, Any] = {"preset": "ultrafast"} if codec == "libx264" else {}
        if codec == "libx264":
            opts["x264-params"] = f"keyint={gop}:min-keyint={gop}:scenecut=0"
        stream.codec_context.options = {**opts, **(options or {})}
        for i in range(num_frames):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(_picture(i), format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def _picture(i: int) -> np.ndarray:
    pixels = np.full((48, BITS * BLOCK, 3), 128, np.uint8)
    pixels[:BLOCK] = 0
    for bit in range(BITS):
        if i >> bit & 1:
            pixels[:BLOCK, bit * BLOCK:(bit + 1) * BLOCK] = 255
    return pixels


def frame_id(img: Image.Image) -> int:
    """The index `gop_clip` drew on this frame."""
    top = np.asarray(img.convert("L"), dtype=np.float32)[1:BLOCK - 1]
    return sum(1 << bit for bit in range(BITS) if top[:, bit * BLOCK + 1:(bit + 1) * BLOCK - 1].mean() > 128)
