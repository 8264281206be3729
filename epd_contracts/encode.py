"""POST /encode (proxy -> encoder) and its reply."""
from __future__ import annotations

from typing import Annotated

import msgspec

from epd_contracts.audio import AudioPart
from epd_contracts.generate import MAX_HASH_CHARS, MAX_LORA_NAME_CHARS, Detail
from epd_contracts.video import VideoPart


class EncodeItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    # The encoder computes each item's mm_hash from its bytes (epd_contracts.hashing) and stores it under that hash
    # only. The field is optional; when given (the proxy always sends it, so a hashing bug is caught) it must
    # equal the computed hash, or the call gets a 400 `hash_mismatch`.
    mm_hash: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HASH_CHARS)] | None = None
    data: str  # base64 of the image file's bytes
    # image_url.detail: "low" encodes at the processor's minimum resolution where the family has a resolution knob
    # (Qwen-style dynamic resolution), and is part of the mm_hash (epd_contracts.hashing.mm_hash)
    detail: Detail = "auto"
    # the image is one of several in its prompt, for a family where that changes its tokens (LLaVA-OneVision);
    # part of the mm_hash (epd_contracts.hashing.multi_image_item)
    multi_image: bool = False
    # the bytes are a video file and the item is these sampled frames of it (epd_contracts/video.py): its mm_hash
    # is epd_contracts.video.part_hash(bytes, video); detail and multi_image stay at their defaults
    video: VideoPart | None = None
    # the bytes are an audio file and the item is these encoder windows of it (epd_contracts/audio.py): its mm_hash
    # is epd_contracts.audio.part_hash(bytes, audio); detail and multi_image stay at their defaults
    audio: AudioPart | None = None
    # an image encoded under this LoRA adapter's vision-tower weights (by its --lora-modules name): its mm_hash is
    # epd_contracts.hashing.adapter_hash of the image's and the name
    lora: Annotated[str, msgspec.Meta(max_length=MAX_LORA_NAME_CHARS)] = ""


class EncodeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    items: list[EncodeItem]  # at most --max-items-per-request (400 beyond)


class EncodedItem(msgspec.Struct, frozen=True, kw_only=True):
    mm_hash: str  # the hash the encoder computed from the bytes (what the embeddings are stored under)
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None
    cached: bool = False  # True: already held, not encoded again


class EncodeResponse(msgspec.Struct, frozen=True, kw_only=True):
    items: list[EncodedItem]
    ec_address: str
    # the producer's cache-event position after storing these: an index that has seen it knows they are held
    ec_epoch: str
    ec_seq: int
