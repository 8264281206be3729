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


def text_sizes(spec: Any, tok: Any) -> dict[str, Any]:
    """The tiny LM's sizes from a TinySpec, for any text config class (LLaMA, Qwen2, Mistral, ...)."""
    return dict(vocab_size=len(tok), hidden_size=spec.text_hidden, intermediate_size=spec.text_hidden * 2,
                num_hidden_layers=spec.text_layers, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, max_position_embeddings=4096, tie_word_embeddings=False,
                **special_ids(tok))
