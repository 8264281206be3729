"""The paged K/V pool and the attention that reads it.

One pool of `num_blocks` blocks of `block_size` positions per layer, for K and for V, all in one tensor (so a
step's new blocks are zeroed, and a fork's block copied, by one op for every layer). A sequence owns a block
table (decoder_service/engine/block_manager.py); a forward writes its new positions through a flat slot mapping
(block * block_size + offset) and attends over its rows' blocks. Block 0 is the null block: always zero, the
padding of block tables. Blocks are zeroed when allocated (`zero`): a masked-out position is still read by the
attention's P @ V with weight 0, and 0 * NaN is NaN, so no block may hand a previous owner's leftovers (possibly
non-finite, from a request that failed) to the next.

One forward packs every row of the step as segments of one token sequence (batch 1): the decode rows first (one
token each), then the prefill chunks. transformers runs the weights over all of them at once; attention goes
through `paged_attention` (registered as the attention implementation "epd_paged"), which splits the packed
queries back into segments:
- CPU (measured in docs/BENCHMARKS.md "Attention over blocks"): the pool is head-major, (kv_heads, blocks,
  block_size, head_dim) per layer. The decode rows' blocks are gathered with one `index_select` into a reused
  workspace (a fresh allocation page-faults: 54 ms against 8 ms into a kept buffer for 64 rows x 992 positions)
  and read as a (rows, heads, positions, head_dim) view by one SDPA call, as fast as contiguous per-row slots;
  each prefill chunk is one SDPA call over its own row's blocks.
- CUDA: the pool is (blocks, block_size, kv_heads, head_dim), the layout `varlen_attn` reads in place through a
  block table (decoder_service/engine/cuda_attention.py), with no gather.
Masks are the family's (FamilyAdapter.attention_mask: Gemma 3's sliding windows and image blocks), per segment
group, built once per forward and shared by every layer.
"""
from __future__ import annotations

import math
import mmap
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from decoder_service.engine.kv_shape import KVShape

ATTENTION = "epd_paged"
_LINUX_MAP_NORESERVE = 0x4000  # <sys/mman.h>; Python's mmap module names it only from 3.13
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


@dataclass
class StepPlan:
    slots: torch.Tensor  # (tokens,) where each packed position's K/V goes: block * block_size + offset
    groups: list[Group] = field(default_factory=list)
    seq_len: int = 0  # get_seq_length (positions already written in the longest row)
    varlen: Any = None  # CUDA: the forward's cuda_attention.VarlenMeta (built by its first layer, or a graph's own)


_current = threading.local()  # the engine thread's plan for the forward in flight


def current_plan() -> StepPlan | None:
    """The plan of the forward in flight on this thread (None outside one)."""
    return getattr(_current, "plan", None)


def _plan() -> StepPlan:
    plan: StepPlan | None = getattr(_current, "plan", None)
    assert plan is not None, "paged attention outside a planned forward"
    return plan


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


class PagedLayer(CacheLayerMixin):
    """One layer's pool; `update` writes the forward's new K/V and hands the pool to the attention."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, head_major: bool):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.head_major = head_major

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # preallocated

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        slots = _plan().slots
        assert self.keys is not None and self.values is not None
        for pool, new in ((self.keys, key_states), (self.values, value_states)):
            states = new[0]  # (kv_heads, tokens, head_dim): the packed forward is batch 1
            if self.head_major:
                pool.view(pool.shape[0], -1, pool.shape[-1]).index_copy_(1, slots, states)
            else:
                pool.view(-1, pool.shape[-2], pool.shape[-1]).index_copy_(0, slots, states.transpose(0, 1))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        plan = getattr(_current, "plan", None)
        return plan.seq_len if plan is not None else 0

    def get_max_length(self) -> int:
        return -1


class PagedCache(Cache):
    """K/V of every layer in one pool of blocks; memory is touched only as blocks are used (torch.empty)."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        self.head_major = self.device.type != "cuda"
        dims = ((shape.kv_heads, num_blocks, block_size, shape.head_dim) if self.head_major
                else (num_blocks, block_size, shape.kv_heads, shape.head_dim))
        # every layer's K and V in one tensor (layers, 2, *dims): zeroing or copying blocks is one op for all
        self.pool = _pool((shape.num_layers, 2, *dims), shape.dtype, self.device)
        self.block_dim = 3 if self.head_major else 2
        layers = [PagedLayer(self.pool[i, 0], self.pool[i, 1], self.head_major) for i in range(shape.num_layers)]
        super().__init__(layers=list(layers))
        self.paged_layers = layers
        self.zero([0])  # the null block
        self._workspace: dict[tuple[int, int], torch.Tensor] = {}  # CPU gathers: (layer parity, K/V) -> buffer

    @property
    def nbytes(self) -> int:
        return self.shape.bytes_per_block(self.block_size) * self.num_blocks

    @torch.inference_mode()
    def zero(self, blocks: list[int]) -> None:
        if not blocks:
            return
        self.pool.index_fill_(self.block_dim, torch.tensor(blocks, device=self.device), 0)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """An n > 1 fork's last, partial prompt block: the one block a fork does not share."""
        self.pool.select(self.block_dim, dst).copy_(self.pool.select(self.block_dim, src))

    def activate(self, plan: StepPlan | None) -> None:
        """The plan the next forward's layers and attention read (engine thread), or None once it is done."""
        _current.plan, _current.cache = plan, (self if plan is not None else None)

    def gather(self, pool: torch.Tensor, table: torch.Tensor, kv_len: int, which: int) -> torch.Tensor:
        """CPU: the rows' blocks as a (rows, kv_heads, kv_len, head_dim) view of a kept workspace."""
        rows, width = table.shape
        need = rows * width * self.block_size
        buf = self._workspace.get((which, 0))
        if buf is None or buf.shape[1] < need:
            buf = torch.empty((self.shape.kv_heads, need, self.shape.head_dim), dtype=pool.dtype, device=pool.device)
            self._workspace[(which, 0)] = buf
        out = buf[:, :need].view(self.shape.kv_heads, rows * width, self.block_size, self.shape.head_dim)
        torch.index_select(pool, 1, table.reshape(-1), out=out)
        return out.view(self.shape.kv_heads, rows, width * self.block_size, self.shape.head_dim)[:, :, :kv_len] \
            .transpose(0, 1)

    def release_workspace(self) -> None:
        self._workspace.clear()


def _pool(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's K or V pool, its memory touched only as blocks are used. On the CPU an anonymous MAP_NORESERVE
    mapping: a reserve the kernel does not charge up front (a quarter of RAM per decoder by default), so a process
    holding pools can still fork (Linux's heuristic overcommit refuses a fork whose private memory looks larger than
    RAM: torch.empty's would count in full)."""
    if device.type != "cpu":
        return torch.empty(dims, dtype=dtype, device=device)
    nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", _LINUX_MAP_NORESERVE)
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1), flags=flags), dtype=dtype,
                            count=math.prod(dims)).view(dims)


def _mask_for(module: Any, mask: Mask) -> torch.Tensor:
    if isinstance(mask, torch.Tensor):
        return mask
    layer_types = getattr(module.config, "layer_types", None)
    kind = layer_types[module.layer_idx] if layer_types else "full_attention"
    return mask[kind]


def paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the packed forward: (1, heads, tokens, dim) -> (1, tokens, heads, dim)."""
    plan = _plan()
    if key.device.type == "cuda":
        from decoder_service.engine.cuda_attention import varlen_paged_attention
        return varlen_paged_attention(module, query, key, value, plan, scaling, kwargs.get("sliding_window")), None
    cache: PagedCache = _current.cache
    gqa = query.shape[1] != cache.shape.kv_heads
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # (tokens, heads, dim)
    for g in plan.groups:
        q = query[0, :, g.first : g.first + g.num_q]  # (heads, num_q, dim)
        q = q.transpose(0, 1).unsqueeze(2) if g.decode else q.unsqueeze(0)  # (rows, heads, new, dim)
        k = cache.gather(key, g.table, g.kv_len, 0)
        v = cache.gather(value, g.table, g.kv_len, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask_for(module, g.mask), scale=scaling,
                                           enable_gqa=gqa)
        out[g.first : g.first + g.num_q] = o.squeeze(2) if g.decode else o[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION, paged_attention)
