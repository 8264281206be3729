"""The aggregated decoder's InlineEncoder: two requests with the same new image encode it once; it keys images by
the hash of their bytes, and one request's failure is that request's error only."""
from __future__ import annotations

import base64
import io
import threading
from typing import Any

import pytest
import torch

from decoder_service.aggregated import InlineCache, InlineEncoder
from epd_common.errors import APIError
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.generate import ImageRef
from epd_contracts.hashing import mm_hash
from tests.factories import make_image


class FakeVision:
    """Counts encodes; the first one finishes only after the second request has missed the cache."""

    lora = None  # no LoRA adapters on its linears (VisionHalf.lora)

    def __init__(self, second_missed: threading.Event):
        self.second_missed = second_missed
        self.calls = 0

    def encode(self, images: list[Any], detail: str = "auto", multi_image: bool = False) -> list[ImageFeatures]:
        self.calls += 1
        assert self.second_missed.wait(timeout=30)
        return [ImageFeatures(embeds=torch.ones(4, 8)) for _ in images]


class SignallingCache(InlineCache):
    """The real cache, plus: a miss seen by the second request's thread sets `second_missed`."""

    def __init__(self, max_bytes: int, second_missed: threading.Event):
        super().__init__(max_bytes)
        self.second_missed = second_missed

    def get_cache_item(self, mm_hash: str) -> ImageFeatures | None:
        out = super().get_cache_item(mm_hash)
        if out is None and threading.current_thread().name == "second":
            self.second_missed.set()
        return out


def png(color: str = "red") -> bytes:
    buf = io.BytesIO()
    make_image(32, 32, color).save(buf, format="PNG")
    return buf.getvalue()


def image_ref(data: bytes, claimed: str | None = None) -> ImageRef:
    return ImageRef(mm_hash=claimed or mm_hash(data), data=base64.b64encode(data).decode())


def test_concurrent_requests_with_the_same_new_image_encode_it_once() -> None:
    ref = image_ref(png())
    second_missed = threading.Event()
    vision = FakeVision(second_missed)
    encoder = InlineEncoder(vision, cache_bytes=1 << 20, max_image_pixels=1 << 20)  # type: ignore[arg-type]
    encoder.store = SignallingCache(1 << 20, second_missed)
    results: dict[str, list[ImageFeatures]] = {}

    def run() -> None:
        results[threading.current_thread().name] = encoder.features([ref])

    threads = [threading.Thread(target=run, name=name) for name in ("first", "second")]
    threads[0].start()
    while vision.calls == 0 and threads[0].is_alive():  # the first request is inside the vision forward
        threads[0].join(timeout=0.01)
    assert vision.calls == 1, "the first request never reached the vision forward"
    threads[1].start()
    for t in threads:
        t.join(timeout=60)
    assert vision.calls == 1 and encoder.num_encoded == 1
    assert torch.equal(results["first"][0].embeds, results["second"][0].embeds)


class ScriptedVision:
    """Encodes 4 x 8 ones, or raises what it is told to for the next call."""

    lora = None  # no LoRA adapters on its linears (VisionHalf.lora)

    def __init__(self) -> None:
        self.fail_with: Exception | None = None
        self.calls = 0
        self.details: list[str] = []

    def encode(self, images: list[Any], detail: str = "auto", multi_image: bool = False) -> list[ImageFeatures]:
        self.calls += 1
        self.details.append(detail)
        if self.fail_with is not None:
            raise self.fail_with
        return [ImageFeatures(embeds=torch.ones(2 if detail == "low" else 4, 8)) for _ in images]


def inline(check: Any = None) -> tuple[InlineEncoder, ScriptedVision]:
    vision = ScriptedVision()
    return InlineEncoder(vision, cache_bytes=1 << 20, max_image_pixels=1 << 20, check=check), vision  # type: ignore[arg-type]


def test_detail_low_is_encoded_as_such_under_its_own_hash_and_cached_apart() -> None:
    encoder, vision = inline()
    red = png("red")
    low = ImageRef(mm_hash=mm_hash(red, "low"), data=base64.b64encode(red).decode(), detail="low")
    (small, hit), = encoder.features_and_hits([low])
    (full, full_hit), = encoder.features_and_hits([image_ref(red)])  # the same bytes at full size: encoded again
    assert vision.details == ["low", "auto"] and small.num_tokens == 2 and full.num_tokens == 4
    assert not hit and not full_hit and encoder.features_and_hits([low])[0][1]  # then each is a hit
    assert encoder.store.has_cache_item(mm_hash(red, "low")) and encoder.store.has_cache_item(mm_hash(red))


def test_a_claimed_hash_that_is_not_the_bytes_hash_is_a_400_and_never_a_cache_key() -> None:
    encoder, vision = inline()
    red, blue = png("red"), png("blue")
    encoder.features([image_ref(red)])
    with pytest.raises(APIError) as err:  # poisoning attempt: blue's bytes under red's hash
        encoder.features([image_ref(blue, claimed=mm_hash(red))])
    assert err.value.status == 400 and err.value.code == "hash_mismatch" and err.value.param == "images.0.mm_hash"
    assert vision.calls == 1 and not encoder.store.has_cache_item(mm_hash(blue))


@pytest.mark.parametrize(("error", "status", "code"), [
    (RuntimeError("CUDA out of memory"), 500, "encode_failed"),
    (ValueError("height:1 must be larger than factor:28"), 400, "invalid_image"),
])
def test_a_vision_failure_is_that_requests_error_and_the_next_request_encodes(
        error: Exception, status: int, code: str) -> None:
    encoder, vision = inline()
    vision.fail_with = error
    with pytest.raises(APIError) as err:
        encoder.features([image_ref(png("red"))])
    assert err.value.status == status and err.value.code == code
    vision.fail_with = None
    assert encoder.features([image_ref(png("red"))])[0].num_tokens == 4 and encoder.num_encoded == 1


def test_features_that_do_not_fit_the_lm_are_refused_and_not_cached() -> None:
    encoder, _ = inline(check=lambda out: "width 8 != this model's embedding width 64")
    with pytest.raises(APIError) as err:
        encoder.features([image_ref(png())])
    assert err.value.status == 500 and err.value.code == "invalid_embeddings" and "width 8" in err.value.message
    assert not encoder.store.has_cache_item(mm_hash(png())) and encoder.num_encoded == 0
