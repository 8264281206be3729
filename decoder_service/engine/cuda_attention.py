"""Attention over the paged pool on CUDA: one `torch.nn.attention.varlen.varlen_attn` call per layer and forward.

The packed forward's sequences (decode rows, one query each, then each prefill chunk) become varlen's N sequences:
`cu_seq_q` from their query counts, `seqused_k` from the positions each reads, and a block table (N, W), every
row 0-padded to the widest (block 0 is the null block). Causality is FlashAttention's: bottom-right aligned, so
a sequence's query j sits at key position seqused_k - num_q + j, which is where the runner wrote it.

- Sliding windows: transformers' window W keeps keys with kv > q - W (masking_utils.sliding_window_overlay; W keys
  with the query's own), which is FlashAttention's window_size=(W - 1, 0) (keys in [q - left, q + right]).
- GQA: enable_gqa (the pool keeps the K/V heads).
- What varlen cannot express: a prefill chunk whose mask is not plain causal (Gemma 3's bidirectional image
  blocks) is attended again by SDPA over its gathered blocks with the family's mask, and that overwrites its rows.
- Paging: torch's vendored FlashAttention-2 takes a paged pool only for pages of a multiple of 256 positions
  (flash_api.cpp: "Paged KV cache block size must be divisible by 256"); `paged_supported` asks the kernel once
  per block size. With smaller blocks the rows' positions are gathered (one index_select per layer, packed exactly
  to their lengths) and varlen reads them unpaged.
- float32 pools (FlashAttention takes fp16/bf16 only) go through `reference_varlen`, the same semantics in plain
  torch (one SDPA per sequence), which is also what the CPU tests feed this module's metadata to.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from decoder_service.engine.step_plan import Group, Mask, StepPlan

HALF = (torch.float16, torch.bfloat16)


class Kernel(Protocol):
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                 cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, scale: float | None = ...,
                 window_size: tuple[int, int] = ..., enable_gqa: bool = ..., seqused_k: torch.Tensor | None = ...,
                 block_table: torch.Tensor | None = ...) -> Any: ...


@dataclass
class VarlenMeta:
    """varlen_attn's inputs for one forward (the same for every layer); int32 tensors on the pool's device."""

    cu_seq_q: torch.Tensor  # (N + 1,) query offsets: decode rows 1 each, then each prefill chunk
    seqused_k: torch.Tensor  # (N,) positions each sequence reads (its new ones included)
    cu_seq_k: torch.Tensor  # (N + 1,) cumulative seqused_k: the packed layout of gathered K/V
    block_table: torch.Tensor  # (N, W) block ids, 0-padded
    max_q: int
    max_k: int
    masked: list[int] = field(default_factory=list)  # plan.groups varlen cannot express (SDPA over their blocks)
    gather_index: torch.Tensor | None = None  # (total_k,) flat pool slots, built on the first gathered layer


def full_mask(mask: Mask) -> torch.Tensor:
    """The full-attention mask of a group (a family's dict holds one per layer type)."""
    if isinstance(mask, torch.Tensor):
        return mask
    return mask["full_attention"] if "full_attention" in mask else next(iter(mask.values()))


def row_lengths(g: Group) -> torch.Tensor:
    """(rows,) int32: the positions each of the group's rows reads, on the table's device."""
    lens = getattr(g, "lens", None)  # the runner's per-row kv lengths, when the plan carries them
    if lens is not None:
        return torch.tensor(lens, dtype=torch.int32).to(g.table.device, non_blocking=True)
    last = full_mask(g.mask)[:, 0, -1, :]  # (rows, kv_len): the last query sees its own position last
    index = torch.arange(1, last.shape[-1] + 1, device=last.device, dtype=torch.int32)
    return (last.to(torch.int32) * index).amax(-1).to(torch.int32)


def is_causal(g: Group) -> bool:
    """A prefill chunk's full mask is plain causal (a sync: checked once a forward, prefill groups only)."""
    mask = full_mask(g.mask)[0, 0]  # (num_q, kv_len)
    kv = torch.arange(g.kv_len, device=mask.device)
    query = torch.arange(g.kv_len - g.num_q, g.kv_len, device=mask.device).view(-1, 1)
    return bool(torch.equal(mask, kv <= query))


def build_meta(plan: StepPlan) -> VarlenMeta:
    """The plan's groups as varlen's sequences."""
    dev = plan.slots.device
    q_lens = [n for g in plan.groups for n in ([1] * g.table.shape[0] if g.decode else [g.num_q])]
    cu_q = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32).to(dev, non_blocking=True)
    used = torch.cat([row_lengths(g) for g in plan.groups])
    cu_k = F.pad(used.cumsum(0, dtype=torch.int32), (1, 0))
    width = max(g.table.shape[1] for g in plan.groups)
    table = torch.cat([F.pad(g.table, (0, width - g.table.shape[1])) for g in plan.groups]).to(torch.int32)
    masked = [i for i, g in enumerate(plan.groups) if not g.decode and not is_causal(g)]
    return VarlenMeta(cu_q, used, cu_k, table.contiguous(), max(q_lens), max(g.kv_len for g in plan.groups), masked)


def meta_of(plan: StepPlan) -> VarlenMeta:
    """Built once a forward and kept on the plan (a captured CUDA graph's plan comes with its own)."""
    meta: VarlenMeta | None = getattr(plan, "varlen", None)
    if meta is None:
        meta = build_meta(plan)
        setattr(plan, "varlen", meta)  # noqa: B010 (StepPlan has no such field yet)
    return meta


@functools.lru_cache(maxsize=8)
def paged_supported(block_size: int, device: str) -> bool:
    """Whether varlen_attn takes a paged pool of this block size on this device (asked once, on a tiny call)."""
    if not device.startswith("cuda"):
        return False
    from torch.nn.attention.varlen import varlen_attn
    pool = torch.zeros(2, block_size, 1, 64, dtype=torch.float16, device=device)
    q = torch.zeros(1, 1, 64, dtype=torch.float16, device=device)
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    try:
        varlen_attn(q, pool, pool, one, one, 1, 1, seqused_k=one[1:], block_table=one[1:].view(1, 1))
    except RuntimeError:
        return False
    return True


def gather_index(meta: VarlenMeta, block_size: int) -> torch.Tensor:
    """(total_k,) the flat pool slot of every position each sequence reads, packed as cu_seq_k lays them out."""
    if meta.gather_index is None:
        total = int(meta.cu_seq_k[-1])  # a sync, once a forward
        n = meta.seqused_k.shape[0]
        row = torch.repeat_interleave(torch.arange(n, device=meta.seqused_k.device), meta.seqused_k,
                                      output_size=total)
        pos = torch.arange(total, device=row.device) - meta.cu_seq_k[:-1].long()[row]
        meta.gather_index = meta.block_table.long()[row, pos // block_size] * block_size + pos % block_size
    return meta.gather_index


def varlen_paged_attention(module: Any, query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                           plan: StepPlan, scaling: float | None, sliding_window: int | None,
                           kernel: Kernel | None = None, paged: bool | None = None) -> torch.Tensor:
    """(1, heads, tokens, dim) queries over the (blocks, block_size, kv_heads, dim) pools -> (1, tokens, heads, dim)."""
    meta = meta_of(plan)
    blocks, block_size, kv_heads, dim = key_pool.shape
    if kernel is None:
        kernel = _flash() if key_pool.is_cuda and key_pool.dtype in HALF else reference_varlen
    if paged is None:
        paged = key_pool.is_cuda and key_pool.dtype in HALF and paged_supported(block_size, str(key_pool.device))
    q = query[0].transpose(0, 1).contiguous()  # (tokens, heads, dim)
    window = (sliding_window - 1, 0) if sliding_window else (-1, 0)
    gqa = q.shape[1] != kv_heads
    if paged:
        out = kernel(q, key_pool, value_pool, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, scale=scaling,
                     window_size=window, enable_gqa=gqa, seqused_k=meta.seqused_k, block_table=meta.block_table)
    else:
        index = gather_index(meta, block_size)
        k = key_pool.view(-1, kv_heads, dim).index_select(0, index)
        v = value_pool.view(-1, kv_heads, dim).index_select(0, index)
        out = kernel(q, k, v, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, scale=scaling,
                     window_size=window, enable_gqa=gqa)
    for i in meta.masked:
        _masked_group(module, q, out, key_pool, value_pool, plan.groups[i], scaling, gqa)
    return out.unsqueeze(0)


def _flash() -> Kernel:
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn


def _layer_mask(module: Any, mask: Mask) -> torch.Tensor:
    if isinstance(mask, torch.Tensor):
        return mask
    layer_types = getattr(module.config, "layer_types", None)
    return mask[layer_types[module.layer_idx] if layer_types else "full_attention"]


def _masked_group(module: Any, q: torch.Tensor, out: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                  g: Group, scaling: float | None, gqa: bool) -> None:
    """One prefill chunk with the family's own mask: SDPA over its row's gathered blocks, written over its rows."""
    rows = slice(g.first, g.first + g.num_q)
    k, v = (_blocks(pool, g.table[0], g.kv_len) for pool in (key_pool, value_pool))
    o = F.scaled_dot_product_attention(q[rows].transpose(0, 1).unsqueeze(0), k, v,
                                       attn_mask=_layer_mask(module, g.mask), scale=scaling, enable_gqa=gqa)
    out[rows] = o[0].transpose(0, 1)


def _blocks(pool: torch.Tensor, table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """One row's blocks as (1, kv_heads, kv_len, dim)."""
    return pool[table].flatten(0, 1)[:kv_len].transpose(0, 1).unsqueeze(0)


def reference_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, scale: float | None = None,
                     window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                     seqused_k: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """varlen_attn's semantics in plain torch, one SDPA per sequence (float32 pools; the tests' reference)."""
    out = torch.empty_like(query)
    cq = cu_seq_q.tolist()
    ck = cu_seq_k.tolist() if cu_seq_k is not None else None
    used = seqused_k.tolist() if seqused_k is not None else None
    for i in range(len(cq) - 1):
        if block_table is not None:
            assert used is not None, "a block table needs seqused_k"
            n_k = used[i]
            k, v = (pool[block_table[i].long()].flatten(0, 1)[:n_k] for pool in (key, value))
        else:
            assert ck is not None, "unpaged K/V needs cu_seq_k"
            n_k = used[i] if used is not None else ck[i + 1] - ck[i]
            k, v = key[ck[i] : ck[i] + n_k], value[ck[i] : ck[i] + n_k]
        q = query[cq[i] : cq[i + 1]]
        allowed = window_mask(q.shape[0], n_k, window_size, query.device)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                           v.transpose(0, 1).unsqueeze(0), attn_mask=allowed, scale=scale,
                                           enable_gqa=enable_gqa)
        out[cq[i] : cq[i + 1]] = o[0].transpose(0, 1)
    return out


def window_mask(num_q: int, num_k: int, window: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(num_q, num_k) bool: FlashAttention's bottom-right aligned window; (-1, 0) is causal, -1 no bound."""
    qpos = torch.arange(num_k - num_q, num_k, device=device).view(-1, 1)
    kpos = torch.arange(num_k, device=device).view(1, -1)
    allowed = torch.ones(num_q, num_k, dtype=torch.bool, device=device)
    left, right = window
    if right >= 0:
        allowed &= kpos <= qpos + right
    if left >= 0:
        allowed &= kpos >= qpos - left
    return allowed
