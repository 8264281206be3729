"""Small factories shared by tests."""
from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import cast

import av
import numpy as np
from PIL import Image, ImageDraw

from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from epd_contracts.embeddings import ImageFeatures


@contextmanager
def ordinary_scheduling() -> Iterator[None]:
    """Put this thread's scheduling policy back after an encode. SVT-AV1's encoder (libsvtav1), run as root, makes
    the thread that opens it SCHED_FIFO 99. Every thread started after that inherits it: engine threads and their
    OpenMP workers would then spin at real-time priority, and on two CPUs they starve everything else, this process's
    own main thread included (a clean-clone CI run hung at exit that way)."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
            os.sched_setscheduler(0, policy, param)


def make_image(width: int, height: int, color: str = "red", shape: str = "circle") -> Image.Image:
    img = Image.new("RGB", (width, height), (128, 128, 128))
    draw = ImageDraw.Draw(img)
    box = (width // 4, height // 4, 3 * width // 4, 3 * height // 4)
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(width // 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=color)
    return img


def make_video(num_frames: int = 10, width: int = 96, height: int = 48, fps: float = 10, codec: str = "libx264",
               container: str = "mp4", num_streams: int = 1) -> bytes:
    """A clip, encoded with PyAV, whose frame i shows a red square 8 pixels wide at x = 4 * i on grey, so a decoded
    frame tells which frame it is (frame_number). `num_streams` copies of the video stream are muxed side by side."""
    buf = io.BytesIO()
    with ordinary_scheduling(), av.open(buf, "w", format=container) as out:
        streams = [cast(av.VideoStream, out.add_stream(codec, rate=Fraction(fps).limit_denominator(1000)))
                   for _ in range(num_streams)]
        for s in streams:
            s.width, s.height, s.pix_fmt = width, height, "yuvj420p" if codec == "mjpeg" else "yuv420p"
            s.codec_context.options = {"preset": "ultrafast"} if codec == "libx264" else {}
        for i in range(num_frames):
            pixels = np.full((height, width, 3), 128, np.uint8)
            pixels[height // 4: 3 * height // 4, 4 * i: 4 * i + 8] = (255, 0, 0)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for s in streams:
                out.mux(s.encode(frame))
        for s in streams:
            out.mux(s.encode())
    return buf.getvalue()


def frame_number(img: Image.Image, source_width: int = 96) -> int:
    """Which frame of make_video `img` is, from where its red square is (the frame may have been downscaled)."""
    rgb = np.asarray(img.convert("RGB")).astype(np.int32)
    redness = (rgb[..., 0] - rgb[..., 1]).clip(0).sum(axis=0)
    centre = np.nonzero(redness > redness.max() / 2)[0].mean() * source_width / img.width
    return round((centre - 3.5) / 4)


def through_connector(features: list[ImageFeatures]) -> list[ImageFeatures]:
    """Items saved in a real ECProducer and gathered back by an ECConsumer over ZeroMQ (what a decoder receives)."""
    producer, consumer = ECProducer(), ECConsumer()
    producer.start()
    try:
        hashes = [f"h{i}" for i in range(len(features))]
        for h, f in zip(hashes, features, strict=True):
            producer.save_caches(h, f)
        got = consumer.gather(hashes, {h: producer.address for h in hashes}, timeout=5.0)
        return [got[h] for h in hashes]
    finally:
        consumer.close()
        producer.close()
