"""POST /generate (proxy -> decoder) and the NDJSON events the decoder streams back (decoder -> proxy)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from epd_contracts.limits import MAX_MESSAGES, MAX_TOTAL_PARTS, parts_error
from epd_contracts.sampling import SamplingParams
from epd_contracts.validation import FieldError

MAX_HASH_CHARS = 256  # a real mm_hash has 64


class ImageRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """One image of a generate request: its hash, and where its embeddings are (or, aggregated, its bytes)."""

    mm_hash: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HASH_CHARS)]
    source: str = ""  # ZeroMQ address of the encoder that holds it (EPD mode)
    data: str | None = None  # base64 image file bytes (aggregated mode: the decoder encodes it)
    pending: bool = False  # still being encoded there: the gather waits for it (pipelined mode)


class GenerateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """POST /generate; an unknown field is a 400, so a proxy and a decoder that disagree find out at once."""

    # chat messages; image parts are {"type": "image"}, in order of `images`
    messages: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    images: Annotated[list[ImageRef], msgspec.Meta(max_length=MAX_TOTAL_PARTS)] = msgspec.field(default_factory=list)
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        """The proxy's caps on content parts, held again here (a caller may reach /generate directly)."""
        error = parts_error([len(c) if isinstance(c := m.get("content"), list) else 0 for m in self.messages])
        if error:
            raise FieldError("messages", error)


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    num_image_tokens: int = 0


class Event(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One NDJSON line: a text delta, the final `done` (with usage), or an `error` after streaming began."""

    type: Literal["delta", "done", "error"]
    text: str = ""
    finish_reason: Literal["stop", "length", "abort"] | None = None
    usage: Usage | None = None
    message: str | None = None
