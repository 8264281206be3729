"""The aggregated decoder's InlineEncoder: two requests with the same new image encode it once."""
from __future__ import annotations

import base64
import io
import threading
from typing import Any

import torch

from connector import EncoderOutput
from decoder_service.aggregated import InlineEncoder
from decoder_service.protocol import ImageRef
from models.base import ImageFeatures
from tests.factories import make_image


class FakeVision:
    """Counts encodes; the first one finishes only after the second request has missed the cache."""

    def __init__(self, second_missed: threading.Event):
        self.second_missed = second_missed
        self.calls = 0

    def encode(self, images: list[Any]) -> list[ImageFeatures]:
        self.calls += 1
        assert self.second_missed.wait(timeout=30)
        return [ImageFeatures(embeds=torch.ones(4, 8)) for _ in images]


class SignallingCache:
    """The real cache, plus: a miss seen by the second request's thread sets `second_missed`."""

    def __init__(self, cache: Any, second_missed: threading.Event):
        self.cache, self.second_missed = cache, second_missed

    def get(self, mm_hash: str) -> EncoderOutput | None:
        out = self.cache.get(mm_hash)
        if out is None and threading.current_thread().name == "second":
            self.second_missed.set()
        return out

    def put(self, out: EncoderOutput) -> None:
        self.cache.put(out)


def test_concurrent_requests_with_the_same_new_image_encode_it_once() -> None:
    buf = io.BytesIO()
    make_image(32, 32).save(buf, format="PNG")
    ref = ImageRef(mm_hash="h", data=base64.b64encode(buf.getvalue()).decode())
    second_missed = threading.Event()
    vision = FakeVision(second_missed)
    encoder = InlineEncoder(vision, cache_bytes=1 << 20, max_image_pixels=1 << 20)  # type: ignore[arg-type]
    encoder.cache = SignallingCache(encoder.cache, second_missed)  # type: ignore[assignment]
    results: dict[str, list[ImageFeatures]] = {}

    def run() -> None:
        results[threading.current_thread().name] = encoder.features([ref])

    threads = [threading.Thread(target=run, name=name) for name in ("first", "second")]
    threads[0].start()
    while vision.calls == 0:  # the first request is inside the vision forward
        threads[0].join(timeout=0.01)
    threads[1].start()
    for t in threads:
        t.join(timeout=60)
    assert vision.calls == 1 and encoder.num_encoded == 1
    assert torch.equal(results["first"][0].embeds, results["second"][0].embeds)
