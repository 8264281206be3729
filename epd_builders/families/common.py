"""What every family builder returns, and helpers they share."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Built:
    config: Any
    processor: Any
    tokenizer: Any
    # weights transformers initialises so that the image has no effect (Gemma 3's zero projector): randomised here
    randomize: Callable[[Any], None] | None = None


def special_ids(tok: Any) -> dict[str, Any]:
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
