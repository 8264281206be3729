"""Prefix cache micro-benchmark (issue 16): COPY a cached prefix's K/V into the sequence's slot row, or SHARE it.

    python -m epd_bench.prefix_share [--json] [--shapes llava-scaled bench] [--prefix 256 1024 4096]
                                     [--decode 16 64 256] [--prefill-max 1024] [--threads 1] [--budget 0.25]

The decoder keeps each running sequence's K/V in a preallocated slot row (decoder_service/engine/slots.py: per layer
(max_slots, kv_heads, max_len, head_dim)); the prefix cache keeps blocks of 16 tokens, one tensor per block of
(layers, 2, kv_heads, 16, head_dim). On admission a cached prefix of P tokens is either

- COPIED once into the slot row: `copy_stack` stacks the blocks into a fresh tensor, then makes one strided copy
  per layer for K and for V (`_scratch`: the stack goes into a buffer kept for reuse; `copy_per_block`: no stack,
  one small copy per block, layer and K/V), or
- SHARED: the slot holds only the new tokens and every forward concatenates the prefix blocks in front of the
  row's K/V in each layer, which is what a non-paged attention pays for sharing (`share_cat`: into a fresh tensor,
  as a forward would; `share_cat_into_buffer`: into a preallocated one, the bandwidth floor).

A cat costs in proportion to the bytes it writes, so the share cost over D decode steps is integrated from the
per-step cost at row lengths 1 and D (trapezoid) rather than by running D forwards. The prefill of P tokens (a
random LlamaModel of the shape, no LM head) is timed for P <= --prefill-max, for scale. Memory: copy holds P
tokens of K/V per running sequence on top of the cache's own blocks, but slot rows are preallocated at max_len,
so sharing frees nothing in this layout (`memory`).

NOTE: one torch thread by default. On this 2-vCPU VM a 32 MiB copy with 2 threads took 2 to 38 ms (the second
vCPU is often busy elsewhere), with 1 thread a steady 3.3 ms; and fresh multi-MiB tensors are expensive here (a
32 MiB torch.stack: 20-67 ms, mostly first-touch page faults, against 5 ms for the copy after it), which is why
the scratch and per-block variants are timed too.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from transformers import LlamaConfig, LlamaModel

from decoder_service.engine.slots import SlotCache
from epd_builders.bench_model import BENCH_SPEC

BLOCK = 16  # tokens per prefix-cache block (the decoder's --prefix-block-size default)


@dataclass(frozen=True)
class LMShape:
    """The parts of an LM that set K/V sizes (and, for the prefill timing, its compute)."""

    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    hidden: int
    intermediate: int

    def config(self, max_len: int) -> LlamaConfig:
        fields: dict[str, Any] = dict(hidden_size=self.hidden, intermediate_size=self.intermediate,
                                      num_hidden_layers=self.layers, num_attention_heads=self.heads,
                                      num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=1024,
                                      max_position_embeddings=max_len, attn_implementation="sdpa")
        return LlamaConfig(**fields)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


SHAPES: dict[str, LMShape] = {
    # LLaVA-1.5-7B (Llama-2-7B: 32 layers, 32 kv heads, head_dim 128, hidden 4096) scaled down, same proportions
    "llava-scaled": LMShape(layers=8, kv_heads=8, head_dim=64, heads=8, hidden=512, intermediate=1376),
    # the bench model's LM (epd_builders/bench_model.py)
    "bench": LMShape(layers=BENCH_SPEC.text_layers, kv_heads=BENCH_SPEC.text_kv_heads,
                     head_dim=BENCH_SPEC.text_hidden // BENCH_SPEC.text_heads, heads=BENCH_SPEC.text_heads,
                     hidden=BENCH_SPEC.text_hidden, intermediate=BENCH_SPEC.text_intermediate),
}


def median_s(fn: Callable[[], object], budget_s: float, min_reps: int = 3, max_reps: int = 200) -> float:
    """Median seconds of fn() after one warm-up call: at least min_reps runs, more while within budget_s."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < min_reps or (spent < budget_s and len(times) < max_reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times)


def make_blocks(shape: LMShape, prefix: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The prefix cache's blocks for `prefix` tokens: one (layers, 2, kv_heads, BLOCK, head_dim) tensor each."""
    assert prefix % BLOCK == 0, f"a cached prefix is whole blocks of {BLOCK}, got {prefix}"
    return [torch.randn(shape.layers, 2, shape.kv_heads, BLOCK, shape.head_dim, dtype=dtype)
            for _ in range(prefix // BLOCK)]


def copy_stack(cache: SlotCache, slot: int, blocks: list[torch.Tensor], scratch: torch.Tensor | None = None) -> None:
    """COPY: stack the blocks (into `scratch` if given, else a fresh tensor), then one strided copy per layer for K
    and for V into the slot's first P columns."""
    n = len(blocks)
    stacked = torch.stack(blocks) if scratch is None else torch.stack(blocks, out=scratch[:n])
    for i, layer in enumerate(cache.slot_layers):  # stacked: (n, layers, 2, kv, BLOCK, hd)
        assert layer.keys is not None and layer.values is not None
        for dst, kv in ((layer.keys, 0), (layer.values, 1)):
            row = dst[slot, :, : n * BLOCK]  # (kv, P, hd), rows max_len apart
            row.view(row.shape[0], n, BLOCK, row.shape[-1]).copy_(stacked[:, i, kv].transpose(0, 1))


def copy_per_block(cache: SlotCache, slot: int, blocks: list[torch.Tensor]) -> None:
    """COPY without the stack: one small copy per block, layer and K/V."""
    for b, block in enumerate(blocks):
        cols = slice(b * BLOCK, (b + 1) * BLOCK)
        for i, layer in enumerate(cache.slot_layers):
            assert layer.keys is not None and layer.values is not None
            layer.keys[slot, :, cols] = block[i, 0]
            layer.values[slot, :, cols] = block[i, 1]


def share_cat(cache: SlotCache, slot: int, blocks: list[torch.Tensor], row_len: int,
              out: torch.Tensor | None = None) -> None:
    """SHARE, one forward's extra work: per layer, cat the prefix blocks in front of the row's K and of its V (into
    a fresh tensor each, as a forward would; into `out`, a (2, kv, P + row_len, hd) buffer, for the floor)."""
    for i, layer in enumerate(cache.slot_layers):
        assert layer.keys is not None and layer.values is not None
        for dst, kv in ((layer.keys, 0), (layer.values, 1)):
            parts = [*(b[i, kv] for b in blocks), dst[slot, :, :row_len]]
            if out is None:
                torch.cat(parts, dim=1)
            else:
                torch.cat(parts, dim=1, out=out[kv])


def prefill_s(shape: LMShape, prefix: int, dtype: torch.dtype) -> float:
    """Seconds to prefill `prefix` tokens through a random LlamaModel of the shape (median of 2, after a warm-up)."""
    torch.manual_seed(0)
    model: Any = LlamaModel(shape.config(prefix))
    model = model.to(dtype).eval()
    ids = torch.randint(0, 1024, (1, prefix))
    with torch.inference_mode():
        model(input_ids=ids[:, :BLOCK], use_cache=False)  # warm-up on a short input
        return median_s(lambda: model(input_ids=ids, use_cache=False), 0.0, min_reps=2)


def measure_prefix(shape: LMShape, cache: SlotCache, scratch: torch.Tensor, prefix: int, decodes: list[int],
                   prefill_max: int, dtype: torch.dtype, budget_s: float) -> dict[str, Any]:
    """One row: copy, share and (if P <= prefill_max) prefill timings for a cached prefix of `prefix` tokens."""
    blocks = make_blocks(shape, prefix, dtype)
    copy = {"copy_stack_ms": median_s(partial(copy_stack, cache, 0, blocks), budget_s) * 1e3,
            "copy_stack_scratch_ms": median_s(partial(copy_stack, cache, 0, blocks, scratch), budget_s) * 1e3,
            "copy_per_block_ms": median_s(partial(copy_per_block, cache, 0, blocks), budget_s) * 1e3}
    best_copy = min(copy.values())
    per_token = shape.kv_bytes_per_token(dtype)
    row: dict[str, Any] = {"prefix_tokens": prefix, "prefix_kv_bytes": prefix * per_token,
                           **{k: round(v, 4) for k, v in copy.items()},
                           "best_copy_gb_per_s": round(prefix * per_token / (best_copy / 1e3) / 1e9, 2)}
    for name, into in (("share_cat", False), ("share_cat_into_buffer", True)):
        step = {}
        for n in sorted({1, *decodes}):
            out = torch.empty(2, shape.kv_heads, prefix + n, shape.head_dim, dtype=dtype) if into else None
            step[n] = median_s(partial(share_cat, cache, 0, blocks, n, out), budget_s) * 1e3
        row[name] = {"per_step_ms": round(step[1], 4),
                     "over_decode_ms": {str(d): round(d * (step[1] + step[d]) / 2, 3) for d in decodes},
                     "break_even_steps": round(best_copy / step[1], 2)}
    prefill_ms = round(prefill_s(shape, prefix, dtype) * 1e3, 2) if prefix <= prefill_max else None
    row["prefill_ms"] = prefill_ms
    row["prefill_over_best_copy"] = round(prefill_ms / best_copy, 1) if prefill_ms is not None else None
    return row


def measure_shape(shape: LMShape, prefixes: list[int], decodes: list[int], prefill_max: int,
                  dtype: torch.dtype, budget_s: float) -> dict[str, Any]:
    per_token = shape.kv_bytes_per_token(dtype)
    max_len = max(prefixes) + max(decodes)
    cache = SlotCache(shape.config(max_len), max_slots=1, max_len=max_len, dtype=dtype)
    scratch = torch.zeros(max(prefixes) // BLOCK, shape.layers, 2, shape.kv_heads, BLOCK, shape.head_dim, dtype=dtype)
    rows = [measure_prefix(shape, cache, scratch, p, decodes, prefill_max, dtype, budget_s) for p in prefixes]
    return {"shape": asdict(shape), "dtype": str(dtype).removeprefix("torch."), "kv_bytes_per_token": per_token,
            "memory": {"slot_row_bytes_at_max_len": max_len * per_token, "max_len": max_len,
                       "note": "slot rows are preallocated at max_len: a copied prefix fills columns the row holds "
                               "anyway (prefix_kv_bytes per running sequence), so sharing saves no memory in this "
                               "layout; the cache keeps its own blocks either way"},
            "rows": rows}


def conclusion(shapes: dict[str, Any]) -> str:
    """One paragraph from the numbers: the cheaper way per shape and P, break-even decode steps, and prefill."""
    parts, wins, even, ratios = [], 0, [], []
    for name, out in shapes.items():
        for r in out["rows"]:
            best = min(r["copy_stack_ms"], r["copy_stack_scratch_ms"], r["copy_per_block_ms"])
            share = r["share_cat"]
            longest = max(share["over_decode_ms"], key=int)
            wins += best < share["over_decode_ms"][longest]
            even.append(share["break_even_steps"])
            if r["prefill_over_best_copy"] is not None:
                ratios.append(r["prefill_over_best_copy"])
            prefill = f"; prefill {r['prefill_ms']:.4g} ms" if r["prefill_ms"] is not None else ""
            parts.append(f"{name} P={r['prefix_tokens']}: copy {best:.3g} ms once (fresh stack "
                         f"{r['copy_stack_ms']:.3g}) vs share {share['per_step_ms']:.3g} ms/step, "
                         f"{share['over_decode_ms'][longest]:.4g} ms over {longest} steps{prefill}")
    prefill = (f"prefilling the prefix instead costs {min(ratios):.3g}-{max(ratios):.3g}x the copy; "
               if ratios else "")
    verdict = (f"Copy is cheaper than sharing over the longest decode in {wins} of {len(parts)} cases: one copy "
               f"costs as much as {min(even):.2g}-{max(even):.2g} decode steps of share-concatenation (each forward "
               f"re-reads and re-writes the whole prefix, per layer), so sharing loses from the "
               f"{'first' if max(even) <= 1 else f'{math.ceil(max(even))}th'} step on and its cost grows with D; "
               f"{prefill}and with slot rows preallocated at max_len sharing saves no memory in this layout (it pays "
               "only with a paged attention that reads the blocks in place). Copy without a fresh torch.stack (per "
               "block, or stacked into a reused scratch buffer): fresh multi-MiB tensors cost page faults on this "
               "VM. ")
    return verdict + "; ".join(parts) + "."


def run(shape_names: list[str], prefixes: list[int], decodes: list[int], prefill_max: int,
        dtype: torch.dtype = torch.float32, budget_s: float = 0.25) -> dict[str, Any]:
    start = time.perf_counter()
    shapes = {name: measure_shape(SHAPES[name], prefixes, decodes, prefill_max, dtype, budget_s)
              for name in shape_names}
    return {"block_tokens": BLOCK, "torch_threads": torch.get_num_threads(), "shapes": shapes,
            "method": "perf_counter medians after a warm-up; share over D steps = D * (step(1) + step(D)) / 2",
            "conclusion": conclusion(shapes), "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser("epd_bench.prefix_share", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llava-scaled", "bench"])
    ap.add_argument("--prefix", nargs="+", type=int, default=[256, 1024, 4096], help="cached prefix tokens P")
    ap.add_argument("--decode", nargs="+", type=int, default=[16, 64, 256], help="decode steps D")
    ap.add_argument("--prefill-max", type=int, default=1024, help="time the prefill only for P up to this (0: never)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady timings on a shared VM)")
    ap.add_argument("--budget", type=float, default=0.25, help="seconds of repeats per timing")
    args = ap.parse_args(argv)
    bad = [p for p in args.prefix if p <= 0 or p % BLOCK]
    if bad or min(args.decode) < 1 or args.threads < 1 or args.budget < 0:
        ap.error(f"--prefix must be positive multiples of {BLOCK}, --decode and --threads >= 1, --budget >= 0")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        out = run(args.shapes, args.prefix, args.decode, args.prefill_max, budget_s=args.budget)
    finally:
        torch.set_num_threads(threads)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for name, shape in out["shapes"].items():
        print(f"{name}: {shape['kv_bytes_per_token']} B of K/V per token")
        for r in shape["rows"]:
            print(f"  P={r['prefix_tokens']:5d} copy {r['copy_stack_ms']:8.3f} ms (scratch "
                  f"{r['copy_stack_scratch_ms']:8.3f}, per block {r['copy_per_block_ms']:8.3f}); share "
                  f"{r['share_cat']['per_step_ms']:8.3f} ms/step, over D {r['share_cat']['over_decode_ms']}; "
                  f"prefill {r['prefill_ms']} ms")
    print(out["conclusion"])


if __name__ == "__main__":
    main()
