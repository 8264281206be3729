"""A prompt's K/V blocks out of the pool and into another worker's pool (E -> P -> D), in the wire's layout.

Every block travels as one tensor of `KVLayout.block_shape`, (num_layers, 2, kv_heads, block_size, head_dim), whatever
the pool's layout on its device (decoder_service/engine/kv_cache.py: head-major on the CPU, block-major on CUDA), so
a CPU prefill worker and a CUDA decode worker (or the other way round) read each other's blocks. `export_blocks`
copies blocks out (one index_select for every layer) to a contiguous host tensor; `import_blocks` writes received
blocks into blocks a row just took, after `check_blocks` has refused anything that is not this model's K/V.
"""
from __future__ import annotations

import torch

from decoder_service.engine.kv_cache import PagedCache
from decoder_service.engine.kv_shape import KVShape
from epd_contracts.kv import KVLayout

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class KVRefused(ValueError):
    """Received blocks that are not this model's K/V (shape, dtype, count, non-finite values)."""


def kv_layout(shape: KVShape, block_size: int, fingerprint: str) -> KVLayout:
    """What this worker's blocks are on the wire (its model's fingerprint included)."""
    if shape.dtype not in _DTYPE_NAMES:
        raise ValueError(f"K/V of dtype {shape.dtype} cannot travel")
    return KVLayout(fingerprint=fingerprint, num_layers=shape.num_layers, kv_heads=shape.kv_heads,
                    head_dim=shape.head_dim, block_size=block_size, dtype=_DTYPE_NAMES[shape.dtype])  # type: ignore[arg-type]


@torch.inference_mode()
def export_blocks(cache: PagedCache, blocks: list[int]) -> torch.Tensor:
    """(len(blocks), *block_shape) on the host, contiguous: the blocks' K and V of every layer."""
    index = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    picked = cache.pool.index_select(cache.block_dim, index)
    # head-major (layers, 2, heads, n, bs, hd) / block-major (layers, 2, n, bs, heads, hd) -> (n, layers, 2, heads, bs, hd)
    out = picked.permute(3, 0, 1, 2, 4, 5) if cache.head_major else picked.permute(2, 0, 1, 4, 3, 5)
    local = out.contiguous().cpu()
    # tensor parallelism: every rank's heads of these blocks, put back together (the wire has all heads)
    return local if cache.mirror is None else cache.mirror.gather_heads(blocks, local)


def check_blocks(data: torch.Tensor, layout: KVLayout, shape: KVShape, block_size: int, num_tokens: int,
                 values: bool = True) -> None:
    """KVRefused unless `data` is (ceil(num_tokens / block_size) blocks or fewer, *block_shape) of this model's dtype,
    every value finite (`values`: False when the transport checked them already, as KVClient.fetch does)."""
    want = (shape.num_layers, 2, shape.kv_heads, block_size, shape.head_dim)
    if layout.block_shape != want or layout.dtype != _DTYPE_NAMES.get(shape.dtype):
        raise KVRefused(f"blocks of layout {layout.block_shape} {layout.dtype}; this model's are {want} {shape.dtype}")
    if data.dtype != shape.dtype or tuple(data.shape[1:]) != want:
        raise KVRefused(f"a {tuple(data.shape)} {data.dtype} tensor is not blocks of {want} {shape.dtype}")
    if data.shape[0] > -(-num_tokens // block_size):
        raise KVRefused(f"{data.shape[0]} blocks for {num_tokens} positions of {block_size}")
    if values and not bool(torch.isfinite(data).all()):
        raise KVRefused("blocks hold non-finite values")


@torch.inference_mode()
def import_blocks(cache: PagedCache, blocks: list[int], data: torch.Tensor, first_position: int,
                  num_tokens: int) -> None:
    """Write `data` (checked) into `blocks`, which hold positions [first_position, ...) of a prompt of `num_tokens`:
    the last block's positions past the prompt are zeroed (the pool's rule for a block's unwritten positions)."""
    assert len(blocks) == data.shape[0], "one received block per taken block"
    if not blocks:
        return
    if cache.mirror is not None:  # tensor parallelism: each rank writes its heads; these are this rank's
        data = cache.mirror.scatter_heads(blocks, data, first_position, num_tokens)
    data = data.to(cache.device, non_blocking=True)
    tail = first_position + len(blocks) * cache.block_size - num_tokens
    if tail > 0:
        data = data.clone()
        data[-1, :, :, :, cache.block_size - tail:] = 0
    index = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    # (n, layers, 2, heads, bs, hd) -> the pool's order with the blocks at its block dimension
    src = data.permute(1, 2, 3, 0, 4, 5) if cache.head_major else data.permute(1, 2, 0, 4, 3, 5)
    cache.pool.index_copy_(cache.block_dim, index, src)
