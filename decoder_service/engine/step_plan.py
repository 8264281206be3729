"""A forward's plan over the paged pool: where each packed position's new K/V goes (`StepPlan.slots`), which rows
attend together with which mask (`Group`), and the plan (and pool) of the forward in flight on the engine thread,
which the cache layers and the attention read (decoder_service/engine/paged_attention.py)."""
from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Mask = torch.Tensor | dict[str, torch.Tensor]


@dataclass
class Group:
    """Rows attended together: `rows` queries each (decode: many rows of 1; prefill: one row of n)."""

    table: torch.Tensor  # (rows, max_blocks) block ids on the cache's device (0-padded)
    kv_len: int  # positions read per row (the longest row's)
    mask: Mask  # (rows, 1, new, kv_len) bool, or the family's masks by layer type
    first: int  # offset of its first query in the packed sequence
    num_q: int  # queries in the packed sequence (rows for decode, n for a chunk)
    decode: bool
    keys: list[Any] = field(default_factory=list)  # the rows' keys, in table order
    lens: list[int] | None = None  # positions each row reads, its new ones included (CUDA: varlen's seqused_k)
    # CPU decode rows under the plain causal mask: `lens` as a tensor, for the in-place kernel (cpu_attention.py)
    lens_tensor: torch.Tensor | None = None


@dataclass
class StepPlan:
    slots: torch.Tensor  # (tokens,) where each packed position's K/V goes: block * block_size + offset
    groups: list[Group] = field(default_factory=list)
    seq_len: int = 0  # get_seq_length (positions already written in the longest row)
    varlen: Any = None  # CUDA: the forward's cuda_attention.VarlenMeta (built by its first layer, or a graph's own)


_current = threading.local()  # the engine thread's plan (and pool) for the forward in flight


def activate(plan: StepPlan | None, cache: Any = None) -> None:
    """The plan (and the PagedCache) the next forward's layers and attention read, or None once it is done."""
    _current.plan, _current.cache = plan, cache


def current_plan() -> StepPlan | None:
    """The plan of the forward in flight on this thread (None outside one)."""
    return getattr(_current, "plan", None)


def plan_in_flight() -> StepPlan:
    plan: StepPlan | None = getattr(_current, "plan", None)
    assert plan is not None, "paged attention outside a planned forward"
    return plan


def cache_in_flight() -> Any:
    """The PagedCache of the forward in flight on this thread."""
    return _current.cache


def int_tensor(values: Sequence[int]) -> torch.Tensor:
    """A host int64 tensor of `values` through a machine array: 5 us for 64 values where torch.tensor takes 29."""
    return torch.frombuffer(array("q", values), dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)


def causal_mask(starts: list[int], num_new: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, 1, num_new, kv_len) bool: row i's query j (at position starts[i] + j) sees positions up to its own;
    kv_len is the longest row's."""
    kv = torch.arange(max(starts) + num_new, device=device).view(1, 1, 1, -1)
    if num_new == 1:  # decode rows
        return kv <= int_tensor(starts).to(device, non_blocking=True).view(-1, 1, 1, 1)
    last = int_tensor(starts).to(device, non_blocking=True).view(-1, 1, 1, 1) \
        + torch.arange(num_new, device=device).view(1, 1, -1, 1)
    return kv <= last
