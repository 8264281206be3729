"""The varlen metadata a step's plan becomes on CUDA, and what it means: fed to a plain-torch varlen over the paged
pool (decoder_service/engine/cuda_attention.py: reference_varlen), it gives what the CPU path of
paged_attention.paged_attention gives, for causal, sliding-window and bidirectional-image (Gemma 3) masks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from decoder_service.engine import paged_attention
from decoder_service.engine.cuda_attention import (
    build_meta,
    meta_of,
    reference_varlen,
    row_lengths,
    varlen_paged_attention,
    window_mask,
)
from decoder_service.engine.kv_cache import PagedCache
from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.step_plan import Group, StepPlan

BS, KV_HEADS, HEADS, DIM, BLOCKS, WINDOW = 4, 2, 4, 8, 40, 3
DECODE = [5, 12, 0]  # the decode rows' positions (each reads start + 1 positions)
CHUNKS = [(8, 5), (0, 7)]  # prefill chunks: (start, new positions)


def _group(tables: list[list[int]], starts: list[int], num_new: int, first: int, decode: bool) -> Group:
    """As StepInputs.group builds it (base adapter: the causal mask itself)."""
    kv_len = max(starts) + num_new
    width = -(-kv_len // BS)
    table = torch.tensor([(t + [0] * width)[:width] for t in tables])
    kv = torch.arange(kv_len).view(1, 1, 1, -1)
    last = torch.tensor(starts).view(-1, 1, 1, 1) + torch.arange(num_new).view(1, 1, -1, 1)
    return Group(table, kv_len, kv <= last, first, len(tables) if decode else num_new, decode)


def _plan() -> StepPlan:
    """3 decode rows, then 2 prefill chunks, each row on blocks of its own drawn from the pool (never block 0)."""
    free = iter(torch.randperm(BLOCKS - 1, generator=torch.Generator().manual_seed(0)).add(1).tolist())
    need = [s + 1 for s in DECODE] + [s + n for s, n in CHUNKS]
    tables = [[next(free) for _ in range(-(-n // BS))] for n in need]
    groups = [_group(tables[:3], DECODE, 1, 0, True)]
    first = len(DECODE)
    for table, (start, n) in zip(tables[3:], CHUNKS, strict=True):
        groups.append(_group([table], [start], n, first, False))
        first += n
    return StepPlan(torch.zeros(first, dtype=torch.long), groups, max(s for s, _ in CHUNKS + [(d, 1) for d in DECODE]))


def _gemma(plan: StepPlan, image: tuple[int, int] | None = None) -> None:
    """Gemma 3's masks by layer type; `image`: [a, b) kv positions of an image block inside the first chunk."""
    for i, g in enumerate(plan.groups):
        full = g.mask
        assert isinstance(full, torch.Tensor)
        if image is not None and i == 1:
            kv = torch.arange(g.kv_len)
            inside = (kv >= image[0]) & (kv < image[1])
            query = torch.arange(g.kv_len - g.num_q, g.kv_len)
            full = full | (inside.view(1, -1) & inside[query].view(-1, 1)).view(1, 1, g.num_q, g.kv_len)
        query = full.sum(-1, keepdim=True) - 1
        g.mask = {"full_attention": full, "sliding_attention": full & (torch.arange(g.kv_len) > query - WINDOW)}


def _pools() -> tuple[PagedCache, torch.Tensor, torch.Tensor]:
    """A CPU cache (head-major) of random K/V, block 0 zero; and its pools in CUDA's layout (blocks, bs, heads, dim)."""
    cache = PagedCache(KVShape(1, KV_HEADS, DIM, torch.float32), BLOCKS, BS)
    layer = cache.paged_layers[0]
    assert layer.keys is not None and layer.values is not None
    torch.manual_seed(1)
    for pool in (layer.keys, layer.values):
        pool.normal_()
        pool[:, 0] = 0
    return cache, layer.keys.permute(1, 2, 0, 3).contiguous(), layer.values.permute(1, 2, 0, 3).contiguous()


def _module(kind: str | None) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(layer_types=[kind] if kind else None), layer_idx=0)


def _cpu(cache: PagedCache, module: SimpleNamespace, query: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    layer = cache.paged_layers[0]
    assert layer.keys is not None and layer.values is not None
    cache.activate(plan)
    try:
        return paged_attention.paged_attention(module, query, layer.keys, layer.values, None, scaling=0.3)[0][0]
    finally:
        cache.activate(None)


def test_metadata_of_three_decode_rows_and_two_prefill_chunks() -> None:
    plan = _plan()
    meta = build_meta(plan)
    assert meta.cu_seq_q.tolist() == [0, 1, 2, 3, 8, 15]  # decode rows 1 query each, then 5 and 7
    assert meta.seqused_k.tolist() == [6, 13, 1, 13, 7] and meta.cu_seq_k.tolist() == [0, 6, 19, 20, 33, 40]
    assert (meta.max_q, meta.max_k, meta.masked) == (7, 13, [])
    assert meta.cu_seq_q.dtype == meta.seqused_k.dtype == meta.block_table.dtype == torch.int32
    rows = [plan.groups[0].table[i].tolist() for i in range(3)] + [g.table[0].tolist() for g in plan.groups[1:]]
    assert meta.block_table.shape == (5, 4) and meta.block_table.tolist() == [(r + [0] * 4)[:4] for r in rows]
    assert all(b != 0 for r, n in zip(meta.block_table.tolist(), [6, 13, 1, 13, 7], strict=True)
               for b in r[: -(-n // BS)])  # every position read is in a real block; padding names the null block


def test_row_lengths_from_the_runner_match_those_read_off_the_mask() -> None:
    plan = _plan()
    _gemma(plan)
    for g in plan.groups:
        derived = row_lengths(g).tolist()
        setattr(g, "lens", [int(x) for x in derived])  # noqa: B010  # what the runner's plan may carry
        assert row_lengths(g).tolist() == derived
    assert [row_lengths(g).tolist() for g in plan.groups] == [[6, 13, 1], [13], [7]]


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("kind", [None, "full_attention", "sliding_attention"])
def test_varlen_over_the_paged_pool_gives_the_cpu_path_output(paged: bool, kind: str | None) -> None:
    cache, keys, values = _pools()
    plan = _plan()
    if kind is not None:
        _gemma(plan)
    query = torch.randn(1, HEADS, 15, DIM)
    module = _module(kind)
    want = _cpu(cache, module, query, plan)
    window = WINDOW if kind == "sliding_attention" else None
    got = varlen_paged_attention(module, query, keys, values, plan, 0.3, window, kernel=reference_varlen, paged=paged)
    assert got.shape == (1, 15, HEADS, DIM)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["full_attention", "sliding_attention"])
def test_a_bidirectional_image_block_falls_back_to_the_familys_mask(kind: str) -> None:
    cache, keys, values = _pools()
    plan = _plan()
    _gemma(plan, image=(9, 12))  # inside the first chunk (queries at 8..12)
    assert meta_of(plan).masked == [1]
    query = torch.randn(1, HEADS, 15, DIM)
    module = _module(kind)
    want = _cpu(cache, module, query, plan)
    window = WINDOW if kind == "sliding_attention" else None
    got = varlen_paged_attention(module, query, keys, values, plan, 0.3, window, kernel=reference_varlen, paged=True)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
    causal = varlen_paged_attention(module, query, keys, values, _plan(), 0.3, window, kernel=reference_varlen,
                                    paged=True)
    assert not torch.allclose(causal[0, 3:8], want[3:8])  # the block changes that chunk: the fallback was needed


def test_the_window_is_transformers_sliding_window_in_flash_attentions_terms() -> None:
    n = 9
    q, k = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    transformers_mask = (k <= q) & (k > q - WINDOW)  # masking_utils: causal and kv_idx > q_idx - sliding_window
    assert torch.equal(window_mask(n, n, (WINDOW - 1, 0), torch.device("cpu")), transformers_mask)
    assert torch.equal(window_mask(2, 5, (-1, 0), torch.device("cpu")), torch.tensor([[1, 1, 1, 1, 0], [1] * 5]).bool())
