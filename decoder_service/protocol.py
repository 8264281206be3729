"""HTTP messages between the proxy and a decoder worker; the response is NDJSON events."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class ImageRef(BaseModel):
    mm_hash: str = Field(min_length=1, max_length=256)
    source: str = ""  # ZeroMQ address of the encoder that holds it (EPD mode)
    data: str | None = None  # base64 image file bytes (aggregated mode: the decoder encodes it)
    pending: bool = False  # still being encoded there: the gather waits for it (pipelined mode)


class GenerateRequest(BaseModel):
    messages: list[dict[str, Any]]  # chat messages; image parts are {"type": "image"}, in order of `images`
    images: list[ImageRef] = []
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: list[str] = Field(default=[], max_length=4)
    ignore_eos: bool = False
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    num_image_tokens: int = 0


class Event(BaseModel):
    """One NDJSON line: a text delta, the final `done`, or an `error` after streaming began."""

    type: Literal["delta", "done", "error"]
    text: str = ""
    finish_reason: Literal["stop", "length", "abort"] | None = None
    usage: Usage | None = None
    message: str | None = None
