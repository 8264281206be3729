"""The paged K/V pool: every layer's K and V in blocks, and the cache layers transformers writes them through.

One pool of `num_blocks` blocks of `block_size` positions per layer, for K and for V, all in one tensor (so a
step's new blocks are zeroed, and a fork's block copied, by one op for every layer). A sequence owns a block
table (decoder_service/engine/block_manager.py); a forward writes its new positions through a flat slot mapping
(block * block_size + offset) and attends over its rows' blocks. Block 0 is the null block: always zero, the
padding of block tables. Blocks are zeroed when allocated (`zero`): a masked-out position is still read by the
attention's P @ V with weight 0, and 0 * NaN is NaN, so no block may hand a previous owner's leftovers (possibly
non-finite, from a request that failed) to the next.

One forward packs every row of the step as segments of one token sequence (batch 1): the decode rows first (one
token each), then the prefill chunks. transformers runs the weights over all of them at once; attention goes
through decoder_service/engine/paged_attention.py (the attention implementation "epd_paged"), which splits the
packed queries back into segments (the step's plan: decoder_service/engine/step_plan.py):
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
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.step_plan import StepPlan, activate, current_plan, plan_in_flight

_LINUX_MAP_NORESERVE = 0x4000  # <sys/mman.h>; Python's mmap module names it only from 3.13


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
        slots = plan_in_flight().slots
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
        plan = current_plan()
        return plan.seq_len if plan is not None else 0

    def get_max_length(self) -> int:
        return -1


class PagedCache(Cache):
    """K/V of every layer in one pool of blocks; memory is touched only as blocks are used (torch.empty)."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.mirror: Any = None  # tensor parallelism: the other ranks' pools (decoder_service/engine/tp/ranks.py)
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
        self.decode_kernel: Any = None  # CPU: the in-place decode attention (cpu_attention.py), once the engine loads it

    @property
    def nbytes(self) -> int:
        return self.shape.bytes_per_block(self.block_size) * self.num_blocks

    @torch.inference_mode()
    def zero(self, blocks: list[int]) -> None:
        if not blocks:
            return
        if self.mirror is not None:
            self.mirror.zero(blocks)
        self.pool.index_fill_(self.block_dim, torch.tensor(blocks, device=self.device), 0)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """An n > 1 fork's last, partial prompt block: the one block a fork does not share."""
        if self.mirror is not None:
            self.mirror.copy_block(src, dst)
        self.pool.select(self.block_dim, dst).copy_(self.pool.select(self.block_dim, src))

    def activate(self, plan: StepPlan | None) -> None:
        """The plan the next forward's layers and attention read (engine thread), or None once it is done."""
        activate(plan, self if plan is not None else None)

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
