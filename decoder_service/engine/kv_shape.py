"""What one token of K/V costs for a checkpoint: layers x 2 (K and V) x K/V heads x head size x dtype bytes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, text_config: Any, dtype: torch.dtype, ranks: int = 1) -> KVShape:
        """The K/V of one token, or of one tensor-parallel rank's share of it (`ranks`: its K/V heads / ranks)."""
        heads = text_config.num_attention_heads
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        return cls(int(text_config.num_hidden_layers), int(kv_heads) // ranks, int(head_dim), dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size
