"""HTTP messages between the proxy and a decoder worker; the response is NDJSON events."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from epd_contracts.limits import MAX_MESSAGES, MAX_TOTAL_PARTS, parts_error
from epd_contracts.sampling import SamplingParams


class ImageRef(BaseModel):
    mm_hash: str = Field(min_length=1, max_length=256)
    source: str = ""  # ZeroMQ address of the encoder that holds it (EPD mode)
    data: str | None = None  # base64 image file bytes (aggregated mode: the decoder encodes it)
    pending: bool = False  # still being encoded there: the gather waits for it (pipelined mode)


class GenerateRequest(BaseModel):
    """POST /generate; an unknown field is a 400, so a proxy and a decoder that disagree find out at once."""

    model_config = ConfigDict(extra="forbid")

    # chat messages; image parts are {"type": "image"}, in order of `images`
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_MESSAGES)
    images: list[ImageRef] = Field(default=[], max_length=MAX_TOTAL_PARTS)
    sampling: SamplingParams = SamplingParams()  # the contract the proxy built (epd_contracts.sampling)

    @field_validator("messages")
    @classmethod
    def _parts(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The proxy's caps on content parts, held again here (a caller may reach /generate directly)."""
        error = parts_error([len(c) if isinstance(c := m.get("content"), list) else 0 for m in messages])
        if error:
            raise ValueError(error)
        return messages


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
