"""The one definition of `mm_hash`: the key an image's embeddings are stored and gathered under.

Torch-free. Computed over the image FILE bytes (as received from the client, before decoding),
with a domain/version tag so a future change of definition cannot collide with today's hashes.
The model name is not part of the hash: a fleet serves one model (the proxy refuses to pair
workers of different models, and decoders check every embedding's shape against their model).

Every process that stores or trusts an embedding computes the hash itself from the bytes with this
function; a hash supplied by a caller is only ever compared against it, never trusted.
"""
from __future__ import annotations

import hashlib

MM_HASH_TAG = b"epd-mm-hash/v2\0"
MM_HASH_HEX_LEN = 64


# families whose image tokens depend on how many images the prompt holds (LLaVA-OneVision: base tile only when
# several): for them an image of a multi-image prompt is encoded and cached apart (`multi_image`)
MULTI_IMAGE_FAMILIES = frozenset({"llava_onevision"})


def mm_hash(data: bytes, detail: str = "auto", multi_image: bool = False) -> str:
    """sha256(tag || data) as lowercase hex (64 characters); image_url.detail "low" (encoded at the minimum
    resolution) hashes as sha256(tag || "detail=low" NUL || data), so its embeddings never meet the full-size ones;
    `multi_image` (see MULTI_IMAGE_FAMILIES) adds "multi_image" NUL after the tag the same way."""
    h = hashlib.sha256(MM_HASH_TAG)
    if detail == "low":
        h.update(b"detail=low\0")
    if multi_image:
        h.update(b"multi_image\0")
    h.update(data)
    return h.hexdigest()


def multi_image_item(family: str | None, num_images: int) -> bool:
    """Whether the images of a prompt with `num_images` images are encoded as multi-image items for `family`."""
    return num_images > 1 and family in MULTI_IMAGE_FAMILIES


def adapter_hash(mm_hash: str, lora: str) -> str:
    """The key of an item encoded under LoRA adapter `lora` whose weights change the vision tower (its embeddings
    differ from the base model's): sha256(tag || "lora=" name NUL || mm_hash), so an item encoded under one adapter
    is never served under another or the base ("" : `mm_hash` itself)."""
    if not lora:
        return mm_hash
    return hashlib.sha256(MM_HASH_TAG + b"lora=" + lora.encode() + b"\0" + mm_hash.encode()).hexdigest()
