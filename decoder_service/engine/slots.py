"""A preallocated KV cache with one row (slot) per running sequence, each at its own length.

Why this layout (measured in ../shared/notes/continuous-batching-on-cpu.md on this machine): per-row
slots scale to 4.7x output tokens/s at 16 sequences and 6.7x at 64 on a small model, where stacking
per-sequence DynamicCaches every step stops scaling past 16 (3.5x / 3.3x). Running sequences stay
packed in slots 0..n-1, so a decode step reads K/V as views and gathers nothing.

NOTE: a row's masked-out columns are still read by the attention matmul (weight 0), and 0 * NaN is NaN:
a slot must never hand one sequence's leftovers (possibly non-finite, e.g. from a request that failed)
to the next. So each slot's written columns are tracked (`dirty`), a slot is zeroed before a new
sequence takes it, and a move zeroes the destination's columns past the moved row's length.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass
class Plan:
    """Where the next forward writes: `rows` slots, row i at columns starts[i] .. starts[i] + num_new - 1."""

    rows: slice
    starts: list[int]
    num_new: int
    # decode's write index (rows, columns) on the cache's device, made once per forward by SlotCache.set_plan
    index: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def kv_len(self) -> int:
        return max(self.starts) + self.num_new


class SlotLayer(CacheLayerMixin):
    """One layer's K/V for every slot; `update` writes the planned columns and returns the rows' views."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, plan: list[Plan]):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self._plan = plan  # shared with the SlotCache: plan[0] is the current forward's

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # preallocated

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan[0]
        assert self.keys is not None and self.values is not None
        keys, values = self.keys[plan.rows], self.values[plan.rows]
        if plan.num_new == 1:  # decode: one write per layer for all rows, each at its own column
            assert plan.index is not None, "planned by SlotCache.set_plan"
            rows, cols = plan.index
            keys[rows, :, cols] = key_states[:, :, 0]
            values[rows, :, cols] = value_states[:, :, 0]
        else:
            for i, start in enumerate(plan.starts):
                keys[i, :, start : start + plan.num_new] = key_states[i]
                values[i, :, start : start + plan.num_new] = value_states[i]
        return keys[:, :, : plan.kv_len], values[:, :, : plan.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._plan[0].kv_len, 0

    def get_seq_length(self) -> int:
        return max(self._plan[0].starts) if self._plan else 0

    def get_max_length(self) -> int:
        assert self.keys is not None
        return int(self.keys.shape[2])


class SlotCache(Cache):
    """K/V of shape (max_slots, kv_heads, max_len, head_dim) per layer, zero-filled (no NaN from masked rows).

    Everything it makes (K/V, masks, write indices) is on `device`, the LM's.
    """

    def __init__(self, text_config: Any, max_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        heads = text_config.num_attention_heads
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        shape = (max_slots, kv_heads, max_len, head_dim)
        self.plan: list[Plan] = []
        self.device = torch.device(device)
        layers = [SlotLayer(torch.zeros(shape, dtype=dtype, device=self.device),
                            torch.zeros(shape, dtype=dtype, device=self.device), self.plan)
                  for _ in range(text_config.num_hidden_layers)]
        super().__init__(layers=list(layers))
        self.slot_layers = layers
        self.max_slots, self.max_len = max_slots, max_len
        self.dirty = [0] * max_slots  # slot -> columns 0..n-1 may hold data (written or moved there)

    @property
    def nbytes(self) -> int:
        """Memory held by the preallocated K/V of every layer."""
        return sum(t.numel() * t.element_size() for layer in self.slot_layers for t in (layer.keys, layer.values)
                   if t is not None)

    def set_plan(self, plan: Plan) -> torch.Tensor:
        """Plan the next forward; returns its boolean attention mask (rows, 1, num_new, kv_len)."""
        assert plan.kv_len <= self.max_len, f"{plan.kv_len} positions exceed the cache's {self.max_len}"
        for i, start in enumerate(plan.starts):  # marked before the forward: a failed one may have written
            slot = plan.rows.start + i
            self.dirty[slot] = max(self.dirty[slot], start + plan.num_new)
        dev = self.device
        starts = torch.tensor(plan.starts).to(dev, non_blocking=True)  # one small host->device copy per forward
        plan.index = (torch.arange(len(plan.starts), device=dev), starts)
        self.plan[:] = [plan]
        kv = torch.arange(plan.kv_len, device=dev).view(1, 1, 1, -1)
        last = starts.view(-1, 1, 1, 1) + torch.arange(plan.num_new, device=dev).view(1, 1, -1, 1)
        return kv <= last  # each new position sees its own row's past and itself, never a masked-out row

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a slot's first `length` positions into another slot (to keep running rows packed)."""
        self.copy(src, dst, length)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Columns [0, length) of `src` into `dst`, the rest of `dst` zeroed (a move, or an n > 1 prompt's fork)."""
        for layer in self.slot_layers:
            assert layer.keys is not None and layer.values is not None
            layer.keys[dst, :, :length] = layer.keys[src, :, :length]
            layer.values[dst, :, :length] = layer.values[src, :, :length]
        self._zero(dst, length, self.dirty[dst])
        self.dirty[dst] = length

    def clear(self, slot: int) -> None:
        """Zero whatever a slot's earlier occupants wrote (before a new sequence takes it)."""
        self._zero(slot, 0, self.dirty[slot])
        self.dirty[slot] = 0

    def _zero(self, slot: int, start: int, end: int) -> None:
        if end > start:
            for layer in self.slot_layers:
                assert layer.keys is not None and layer.values is not None
                layer.keys[slot, :, start:end] = 0
                layer.values[slot, :, start:end] = 0
