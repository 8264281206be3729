"""Encode each image once per mm_hash: the one algorithm of the encoder worker and the aggregated decoder.

Held items come from the store; the rest are decoded first (so bad bytes fail the call before any vision
work), then encoded in batches of at most `max_batch_size` under one lock (the store is asked again after
taking it: a call that waited may find its images encoded by the one before), checked, and stored by hash.
If anything fails, the store is told which items will not come (`mark_failed`), so a decoder already waiting
for them (a pipelined gather) hears it now, not at its timeout.

The store is the encoder's connector producer, or the aggregated decoder's own cache: this module imports
neither, only the four methods it needs (`EmbeddingStore`).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from PIL import Image

from epd_common.images import ImageError, load_image
from epd_contracts.embeddings import ImageFeatures
from epd_models.halves import VisionHalf

logger = logging.getLogger("epd.encoder")
Check = Callable[[ImageFeatures], "str | None"]  # a reason to refuse an embedding, or None


class EmbeddingStore(Protocol):
    """Where encoded items are kept by mm_hash (the names of the connector's producer)."""

    def get_cache_item(self, mm_hash: str) -> ImageFeatures | None: ...

    def has_cache_item(self, mm_hash: str) -> bool: ...

    def save_caches(self, mm_hash: str, features: ImageFeatures) -> None: ...

    def mark_failed(self, mm_hashes: list[str]) -> None: ...


class UndecodableImage(ImageError):
    """An item's bytes are not an image we accept (the message says why); `mm_hash` names the item."""

    def __init__(self, mm_hash: str, cause: ImageError):
        super().__init__(str(cause))
        self.mm_hash = mm_hash


class EmbeddingsRefused(Exception):
    """The check refused encoded items (mm_hash -> why); none of their batch was stored."""

    def __init__(self, reasons: dict[str, str]):
        super().__init__(reasons)
        self.reasons = reasons


@dataclass(frozen=True)
class Encoded:
    features: ImageFeatures
    cached: bool  # held before this call asked for it (not encoded by it)


class CachingEncoder:
    """Encodes what `store` does not hold yet, one vision forward at a time; counts what it did."""

    def __init__(self, vision: VisionHalf, store: EmbeddingStore, max_batch_size: int = 16,
                 max_image_pixels: int = 40_000_000, check: Check | None = None):
        self.vision, self.store, self.check = vision, store, check
        self.max_batch_size, self.max_image_pixels = max_batch_size, max_image_pixels
        self.num_encoded = 0  # items that went through the vision tower
        self.num_already_cached = 0  # items asked for that were already held
        self._lock = threading.Lock()

    def encode(self, items: Mapping[str, bytes], details: Mapping[str, str] | None = None,
               multi_image: Collection[str] = ()) -> dict[str, Encoded]:
        """Each item's features by mm_hash. Raises UndecodableImage, EmbeddingsRefused, or what the vision raised.

        `details`: mm_hash -> image_url.detail for items not at "auto" (their hash already says so: epd_contracts.
        hashing); `multi_image`: the items encoded as one of several images of their prompt (the same); items of
        one detail and multi_image are batched together.
        """
        done = self._held(items)
        todo = {h: data for h, data in items.items() if h not in done}
        if not todo:
            return done
        try:
            images = {h: self._load(h, data) for h, data in todo.items()}
            with self._lock:
                done.update(self._held([h for h in images if self.store.has_cache_item(h)]))  # no miss counted twice
                groups = _by_detail([h for h in images if h not in done], details or {}, multi_image)
                for (detail, multi), hashes in groups.items():
                    for start in range(0, len(hashes), self.max_batch_size):
                        batch = {h: images[h] for h in hashes[start : start + self.max_batch_size]}
                        done.update(self._encode_batch(batch, detail, multi))
        except BaseException:
            self.store.mark_failed([h for h in todo if h not in done])
            raise
        return done

    def _held(self, hashes: Iterable[str]) -> dict[str, Encoded]:
        held = {h: Encoded(f, cached=True) for h in hashes if (f := self.store.get_cache_item(h)) is not None}
        self.num_already_cached += len(held)
        return held

    def _load(self, mm_hash: str, data: bytes) -> Image.Image:
        try:
            return load_image(data, self.max_image_pixels)
        except ImageError as exc:
            raise UndecodableImage(mm_hash, exc) from exc

    def _encode_batch(self, images: dict[str, Image.Image], detail: str = "auto",
                      multi_image: bool = False) -> dict[str, Encoded]:
        """Encode, check and store one batch (under the lock)."""
        # the vision half runs on its device and hands back CPU tensors (one copy per batch): the connector
        # sends their memory as ZeroMQ frames without copying
        outs = dict(zip(images, self.vision.encode(list(images.values()), detail, multi_image), strict=True))
        refused = {h: why for h, out in outs.items() if self.check is not None and (why := self.check(out))}
        if refused:
            raise EmbeddingsRefused(refused)
        for h, out in outs.items():
            self.store.save_caches(h, out)
        self.num_encoded += len(outs)
        logger.info("encoded %d item(s)", len(outs))
        return {h: Encoded(out, cached=False) for h, out in outs.items()}


def _by_detail(hashes: list[str], details: Mapping[str, str],
               multi_image: Collection[str]) -> dict[tuple[str, bool], list[str]]:
    groups: dict[tuple[str, bool], list[str]] = {}
    for h in hashes:
        groups.setdefault((details.get(h, "auto"), h in multi_image), []).append(h)
    return groups
