"""Aggregated mode: the decoder also holds the vision half and encodes images sent inline (no connector).

This is the one-process baseline the benchmarks compare EPD against, and the simplest deployment.

Trust: the cache key of an image is computed here from its bytes (`epd_contracts.hashing.mm_hash`); a caller's
`mm_hash` that differs is refused with 400 `hash_mismatch`, so no caller can choose what an image is cached
under. Faults: an image that cannot be preprocessed is that request's 400; a vision forward that fails is that
request's 500 (`encode_failed`); features that do not fit this decoder's LM (`check`) are its 500
(`invalid_embeddings`) and are not cached. Nothing here ends the process or another request.
"""
from __future__ import annotations

import base64
import binascii
import logging
import threading
from collections.abc import Callable

from PIL import Image

from connector import EncoderOutput
from connector.cache import EmbeddingCache
from decoder_service.protocol import ImageRef
from epd_common.errors import APIError, bad_request
from epd_contracts.hashing import mm_hash
from epd_models.base import ImageFeatures
from epd_models.halves import VisionHalf
from epd_models.images import ImageError, load_image

logger = logging.getLogger("epd.decoder")
Check = Callable[[EncoderOutput], "str | None"]  # a reason to refuse an embedding, or None


class InlineEncoder:
    """Encodes each distinct image once (cached by the mm_hash of its bytes); one vision forward at a time."""

    def __init__(self, vision: VisionHalf, cache_bytes: int, max_image_pixels: int, check: Check | None = None):
        self.vision, self.max_image_pixels, self.check = vision, max_image_pixels, check
        self.cache = EmbeddingCache(cache_bytes)
        self._lock = threading.Lock()
        self.num_encoded = 0

    def features(self, images: list[ImageRef]) -> list[ImageFeatures]:
        """Features for each image in order; raises an APIError (4xx or 5xx) that ends this request only."""
        data = [self._bytes(i, im) for i, im in enumerate(images)]
        hashes = [mm_hash(d) for d in data]
        for i, (im, h) in enumerate(zip(images, hashes, strict=True)):
            if im.mm_hash and im.mm_hash != h:
                raise bad_request(f"images[{i}].mm_hash does not match the image bytes", param=f"images.{i}.mm_hash",
                                  code="hash_mismatch")
        found = {h: out for h in hashes if (out := self.cache.get(h)) is not None}
        todo = {h: self._load(i, d) for i, (h, d) in enumerate(zip(hashes, data, strict=True)) if h not in found}
        if todo:
            with self._lock:  # a request that waited here may find its images encoded by the one before it
                found.update((h, out) for h in todo if (out := self.cache.get(h)) is not None)
                todo = {h: image for h, image in todo.items() if h not in found}
                found.update(self._encode(todo))
        return [ImageFeatures(embeds=found[h].embeds, grid_thw=found[h].grid_thw) for h in hashes]

    def _encode(self, todo: dict[str, Image.Image]) -> dict[str, EncoderOutput]:
        """Encode, check and cache new images (under the lock)."""
        if not todo:
            return {}
        try:
            encoded = self.vision.encode(list(todo.values()))
        except ValueError as exc:  # the image processor refuses this image (e.g. too small to patch)
            raise bad_request(f"image cannot be encoded: {exc}", param="images", code="invalid_image") from exc
        except Exception as exc:
            logger.exception("inline vision encode of %d image(s) failed", len(todo))
            raise APIError(500, f"image encoding failed: {type(exc).__name__}", param="images",
                           code="encode_failed") from exc
        outs = {h: EncoderOutput(h, feat.embeds, feat.grid_thw) for h, feat in zip(todo, encoded, strict=True)}
        refused = {h: why for h, out in outs.items() if self.check is not None and (why := self.check(out))}
        if refused:
            logger.error("inline encoder output refused: %s", refused)
            raise APIError(500, "image embeddings do not fit this model: " + "; ".join(refused.values()),
                           param="images", code="invalid_embeddings")
        for out in outs.values():
            self.cache.put(out)
        self.num_encoded += len(outs)
        return outs

    def _bytes(self, index: int, im: ImageRef) -> bytes:
        if im.data is None:
            raise bad_request(f"images[{index}] has no inline data; an aggregated decoder encodes images itself",
                              param=f"images.{index}.data")
        try:
            return base64.b64decode(im.data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise bad_request(f"images[{index}]: {exc}", param=f"images.{index}.data", code="invalid_base64") from exc

    def _load(self, index: int, data: bytes) -> Image.Image:
        try:
            return load_image(data, self.max_image_pixels)
        except ImageError as exc:
            raise bad_request(f"images[{index}]: {exc}", param=f"images.{index}.data", code="invalid_image") from exc
