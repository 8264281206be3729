"""HTTP messages between the proxy and an encoder worker."""
from __future__ import annotations

from pydantic import BaseModel, Field


class EncodeItem(BaseModel):
    mm_hash: str = Field(min_length=1, max_length=256)
    data: str  # base64 of the image file's bytes


class EncodeRequest(BaseModel):
    items: list[EncodeItem]


class EncodedItem(BaseModel):
    mm_hash: str
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None
    cached: bool = False  # True: already held, not encoded again


class EncodeResponse(BaseModel):
    items: list[EncodedItem]
    ec_address: str
    # the producer's cache-event position after storing these: an index that has seen it knows they are held
    ec_epoch: str
    ec_seq: int
