"""Aggregated mode: the decoder also holds the vision half and encodes images sent inline (no connector).

This is the one-process baseline the benchmarks compare EPD against, and the simplest deployment.
"""
from __future__ import annotations

import base64
import binascii
import threading

from PIL import Image

from common.errors import bad_request
from connector import EncoderOutput
from connector.cache import EmbeddingCache
from decoder_service.protocol import ImageRef
from models.base import ImageFeatures
from models.halves import VisionHalf
from models.images import ImageError, load_image


class InlineEncoder:
    """Encodes each distinct image once (cached by mm_hash); one vision forward at a time."""

    def __init__(self, vision: VisionHalf, cache_bytes: int, max_image_pixels: int):
        self.vision, self.max_image_pixels = vision, max_image_pixels
        self.cache = EmbeddingCache(cache_bytes)
        self._lock = threading.Lock()
        self.num_encoded = 0

    def features(self, images: list[ImageRef]) -> list[ImageFeatures]:
        """Features for each image in order; raises a 400 APIError for an image that cannot be used."""
        found = {im.mm_hash: out for im in images if (out := self.cache.get(im.mm_hash)) is not None}
        todo = {im.mm_hash: self._load(i, im) for i, im in enumerate(images) if im.mm_hash not in found}
        if todo:
            with self._lock:  # a request that waited here may find its images encoded by the one before it
                found.update((h, out) for h in todo if (out := self.cache.get(h)) is not None)
                todo = {h: image for h, image in todo.items() if h not in found}
                encoded = self.vision.encode(list(todo.values())) if todo else []
                for mm_hash, feat in zip(todo, encoded, strict=True):
                    found[mm_hash] = EncoderOutput(mm_hash, feat.embeds, feat.grid_thw)
                    self.cache.put(found[mm_hash])
                self.num_encoded += len(todo)
        return [ImageFeatures(embeds=found[im.mm_hash].embeds, grid_thw=found[im.mm_hash].grid_thw) for im in images]

    def _load(self, index: int, im: ImageRef) -> Image.Image:
        if im.data is None:
            raise bad_request(f"images[{index}] has no inline data; an aggregated decoder encodes images itself",
                              param=f"images.{index}.data")
        try:
            return load_image(base64.b64decode(im.data, validate=True), self.max_image_pixels)
        except (binascii.Error, ValueError) as exc:
            code = "invalid_image" if isinstance(exc, ImageError) else "invalid_base64"
            raise bad_request(f"images[{index}]: {exc}", param=f"images.{index}.data", code=code) from exc
