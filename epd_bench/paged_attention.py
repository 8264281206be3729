"""Decode attention over a paged K/V pool on this CPU: which layout and gather the engine uses, and what it costs.

    python -m epd_bench.paged_attention [--json] [--rows 16 64] [--positions 992] [--repeats 10]

One layer's decode attention for R rows of P positions each (bench-lm's shape: 8 query heads, 4 K/V heads, head
size 64, float32), blocks of 16 scattered at random over a pool:
- `slots_sdpa_ms`: SDPA over contiguous per-row K/V (the slot cache this engine had before its paged pool): the floor;
- `gather_fresh_ms` / `gather_kept_ms`: the rows' blocks gathered with `index_select` into a new tensor, or into a
  kept workspace (what `PagedCache.gather` does);
- `paged_head_major_ms`: gather into the workspace + SDPA over the (rows, heads, positions, dim) view of a
  head-major pool, (kv_heads, blocks, block, dim) — the engine's CPU path with `--cpu-sdpa-attention`;
- `kernel_ms`: the C++ kernel reading the head-major pool in place (decoder_service/engine/cpu_attention.py) — the
  engine's CPU default (absent where it cannot be built);
- `paged_block_major_ms`: the same over a block-major pool, (blocks, block, kv_heads, dim) — varlen's layout,
  which needs a transposing copy before SDPA on the CPU.
Medians of `repeats` calls after one warm-up.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from epd_bench.micro import emit, median_s, parser

if TYPE_CHECKING:
    import torch

HEADS, KV_HEADS, DIM, BLOCK = 8, 4, 64, 16


def _ms(fn: Callable[[], object], repeats: int) -> float:
    return round(median_s(fn, repeats) * 1e3, 3)


def measure(rows: int, positions: int, repeats: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from decoder_service.engine import cpu_attention

    width = positions // BLOCK
    num_blocks = rows * width + 1
    table = (torch.randperm(num_blocks - 1)[: rows * width] + 1).view(rows, width)
    flat = table.reshape(-1)
    q = torch.randn(rows, HEADS, 1, DIM)
    mask = torch.ones(rows, 1, 1, positions, dtype=torch.bool)
    slots = torch.randn(rows, KV_HEADS, positions, DIM)
    head_major = torch.randn(KV_HEADS, num_blocks, BLOCK, DIM)
    block_major = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM)
    kept = torch.empty(KV_HEADS, rows * width, BLOCK, DIM)

    def gather_kept() -> torch.Tensor:
        torch.index_select(head_major, 1, flat, out=kept)
        return kept.view(KV_HEADS, rows, positions, DIM).transpose(0, 1)

    def sdpa(k: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)

    def block_major_path() -> torch.Tensor:
        k = block_major.index_select(0, flat).view(rows, positions, KV_HEADS, DIM).transpose(1, 2)
        return sdpa(k.contiguous())

    out = torch.empty(rows, HEADS, DIM)
    lens = torch.full((rows,), positions)
    kernel = cpu_attention.load()
    extra = {} if kernel is None else {"kernel_ms": _ms(
        lambda: kernel.paged_decode(q[:, :, 0], head_major, head_major, table, lens, DIM ** -0.5, out), repeats)}
    return {"rows": rows, "positions": positions, **extra,
            "slots_sdpa_ms": _ms(lambda: sdpa(slots), repeats),
            "gather_fresh_ms": _ms(lambda: torch.index_select(head_major, 1, flat), repeats),
            "gather_kept_ms": _ms(gather_kept, repeats),
            "paged_head_major_ms": _ms(lambda: sdpa(gather_kept()), repeats),
            "paged_block_major_ms": _ms(block_major_path, repeats)}


def main(argv: list[str] | None = None) -> None:
    ap = parser("paged_attention", __doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--positions", type=int, default=992, help="per row, a multiple of 16")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    if args.positions % BLOCK:
        ap.error(f"--positions: a multiple of the block size, {BLOCK}")
    import torch

    torch.manual_seed(0)
    with torch.inference_mode():
        out = [measure(r, args.positions, args.repeats) for r in args.rows]
    emit(out, args.json, lambda rows: "\n".join(" ".join(f"{k}={v}" for k, v in row.items()) for row in rows))


if __name__ == "__main__":
    main()
