"""HTTP messages between the proxy and an encoder worker."""
from __future__ import annotations

from pydantic import BaseModel, Field


class EncodeItem(BaseModel):
    # The encoder computes each item's mm_hash from its bytes (epd_contracts.hashing) and stores it under that hash
    # only. The field is optional; when given (the proxy always sends it, so a hashing bug is caught) it must
    # equal the computed hash, or the call gets a 400 `hash_mismatch`.
    mm_hash: str | None = Field(default=None, min_length=1, max_length=256)
    data: str  # base64 of the image file's bytes


class EncodeRequest(BaseModel):
    items: list[EncodeItem]  # at most --max-items-per-request (400 beyond)


class EncodedItem(BaseModel):
    mm_hash: str  # the hash the encoder computed from the bytes (what the embeddings are stored under)
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None
    cached: bool = False  # True: already held, not encoded again


class EncodeResponse(BaseModel):
    items: list[EncodedItem]
    ec_address: str
    # the producer's cache-event position after storing these: an index that has seen it knows they are held
    ec_epoch: str
    ec_seq: int
