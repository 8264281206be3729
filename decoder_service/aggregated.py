"""Aggregated mode: the decoder also holds the vision half and encodes images sent inline (no connector).

This is the one-process baseline the benchmarks compare EPD against, and the simplest deployment. Encoding
each image once is `epd_models.encode.CachingEncoder`, the encoder worker's algorithm, with this decoder's own
cache as its store.

Trust: the cache key of an image is computed here from its bytes (`epd_contracts.hashing.mm_hash`); a caller's
`mm_hash` that differs is refused with 400 `hash_mismatch`, so no caller can choose what an image is cached
under. Faults: an image that cannot be preprocessed is that request's 400; a vision forward that fails is that
request's 500 (`encode_failed`); features that do not fit this decoder's LM (`check`) are its 500
(`invalid_embeddings`) and are not cached. Nothing here ends the process or another request.

A video (an ImageRef with `video`: the whole video's sampling, first 0 and count = total, no chunks) is encoded
whole through the same CachingEncoder video path the encoder worker takes, keyed by
`epd_contracts.video.part_hash` of its bytes and sampling (the video's hash), under this decoder's VideoLimits; a
video that cannot be used is a 400 with the code the encoder would answer (invalid_video, video_too_large,
video_plan_mismatch, video_not_supported). An audio clip (an ImageRef with `audio`, the whole clip) the same, by
the audio path (epd_models/audio_jobs.py), keyed by `epd_contracts.audio.part_hash`, under this decoder's
AudioLimits; its features are marked as audio (ImageFeatures.audio) for the splice.
"""
from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Mapping

from connector.tensors.cache import EmbeddingCache
from epd_common.audio_limits import AudioLimits
from epd_common.errors import APIError, bad_request
from epd_common.video import VideoLimits
from epd_contracts.audio import AudioPart
from epd_contracts.audio import part_hash as audio_part_hash
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.generate import ImageRef
from epd_contracts.hashing import mm_hash
from epd_contracts.video import VideoPart, part_hash
from epd_models.audio_jobs import UndecodableAudio
from epd_models.encode import CachingEncoder, Check, EmbeddingsRefused, Encoded, UndecodableImage
from epd_models.halves import VisionHalf
from epd_models.video_jobs import UndecodableVideo

logger = logging.getLogger("epd.decoder")


class InlineCache(EmbeddingCache[ImageFeatures]):
    """This decoder's embedding cache, under the producer's names (the store a CachingEncoder fills)."""

    def get_cache_item(self, mm_hash: str) -> ImageFeatures | None:
        return self.get(mm_hash)

    def has_cache_item(self, mm_hash: str) -> bool:
        return mm_hash in self

    def save_caches(self, mm_hash: str, features: ImageFeatures) -> None:
        self.put(mm_hash, features)

    def mark_failed(self, mm_hashes: list[str]) -> None:
        pass  # nobody else waits for an inline item


class InlineEncoder(CachingEncoder):
    """Encodes each distinct image once (cached by the mm_hash of its bytes); one vision forward at a time."""

    def __init__(self, vision: VisionHalf, cache_bytes: int, max_image_pixels: int, check: Check | None = None,
                 video_limits: VideoLimits | None = None, audio_limits: AudioLimits | None = None):
        super().__init__(vision, InlineCache(cache_bytes), max_image_pixels=max_image_pixels, check=check,
                         video_limits=video_limits, audio_limits=audio_limits)

    def features(self, images: list[ImageRef]) -> list[ImageFeatures]:
        """Features for each image in order; raises an APIError (4xx or 5xx) that ends this request only."""
        return [features for features, _ in self.features_and_hits(images)]

    def features_and_hits(self, images: list[ImageRef]) -> list[tuple[ImageFeatures, bool]]:
        """(features, was already cached here) for each image in order: the hits are usage's cached_tokens."""
        data = [self._bytes(i, im) for i, im in enumerate(images)]
        hashes = [self._hash(i, d, im) for i, (d, im) in enumerate(zip(data, images, strict=True))]
        for i, (im, h) in enumerate(zip(images, hashes, strict=True)):
            if im.mm_hash and im.mm_hash != h:
                what = ("video bytes and sampling" if im.video is not None else "audio bytes and rate"
                        if im.audio is not None else "image bytes")
                raise bad_request(f"images[{i}].mm_hash does not match the {what}", param=f"images.{i}.mm_hash",
                                  code="hash_mismatch")
        details = {h: im.detail for h, im in zip(hashes, images, strict=True) if im.detail != "auto"}
        multi = {h for h, im in zip(hashes, images, strict=True) if im.multi_image}
        videos = {h: im.video for h, im in zip(hashes, images, strict=True) if im.video is not None}
        audios = {h: im.audio for h, im in zip(hashes, images, strict=True) if im.audio is not None}
        done = self._encode_request(hashes, data, details, multi, videos, audios)
        return [(done[h].features.as_audio(im.in_video) if im.audio is not None else done[h].features, done[h].cached)
                for h, im in zip(hashes, images, strict=True)]

    def _hash(self, index: int, data: bytes, im: ImageRef) -> str:
        """What the item is cached under: an image's mm_hash, or a whole video's hash (its one part's)."""
        if im.audio is not None:
            if im.chunks:
                raise bad_request(f"images[{index}] is audio in chunks; an aggregated decoder encodes whole clips",
                                  param=f"images.{index}.audio")
            return audio_part_hash(data, im.audio)
        if im.video is None:
            return mm_hash(data, im.detail, im.multi_image)
        if im.chunks or im.video.first != 0 or not im.video.last:
            raise bad_request(f"images[{index}] is a video in chunks; an aggregated decoder encodes whole videos",
                              param=f"images.{index}.video")
        return part_hash(data, im.video)

    def _encode_request(self, hashes: list[str], data: list[bytes], details: Mapping[str, str],
                        multi: set[str], videos: Mapping[str, VideoPart],
                        audios: Mapping[str, AudioPart]) -> dict[str, Encoded]:
        """`encode`, its failures turned into this request's APIError."""
        try:
            return self.encode(dict(zip(hashes, data, strict=True)), details, multi, videos, audios)
        except UndecodableImage as exc:
            i = hashes.index(exc.mm_hash)
            raise bad_request(f"images[{i}]: {exc}", param=f"images.{i}.data", code="invalid_image") from exc
        except (UndecodableVideo, UndecodableAudio) as exc:
            i = hashes.index(exc.mm_hash)
            raise bad_request(f"images[{i}]: {exc}", param=f"images.{i}.data", code=exc.code) from exc
        except EmbeddingsRefused as exc:
            logger.error("inline encoder output refused: %s", exc.reasons)
            raise APIError(500, "image embeddings do not fit this model: " + "; ".join(exc.reasons.values()),
                           param="images", code="invalid_embeddings") from exc
        except ValueError as exc:  # the image processor refuses this image (e.g. too small to patch)
            raise bad_request(f"image cannot be encoded: {exc}", param="images", code="invalid_image") from exc
        except Exception as exc:
            logger.exception("inline vision encode of %d image(s) failed", len(hashes))
            raise APIError(500, f"image encoding failed: {type(exc).__name__}", param="images",
                           code="encode_failed") from exc

    def _bytes(self, index: int, im: ImageRef) -> bytes:
        if im.data is None:
            raise bad_request(f"images[{index}] has no inline data; an aggregated decoder encodes images itself",
                              param=f"images.{index}.data")
        try:
            return base64.b64decode(im.data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise bad_request(f"images[{index}]: {exc}", param=f"images.{index}.data", code="invalid_base64") from exc
