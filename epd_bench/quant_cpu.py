"""What quantized weights cost and give on the CPU, side by side in one run (docs/BENCHMARKS.md "Quantized
checkpoints"):

    python -m epd_bench.quant_cpu [--rounds 5] [--json]

1. Kernels: one linear of a real model's shape (Qwen2.5-VL-7B's MLP, 3584 -> 18944, and its attention output,
   3584 -> 3584) at 1 and 16 rows: F.linear on bf16 weights (what a bf16 checkpoint runs; the dequantized path)
   against the kept-quantized kernels the CPU has (epd_models/quant/linear.py: tinygemm int4 for AWQ / GPTQ /
   compressed-tensors int4, torch._scaled_mm with row-wise scales for per-channel FP8, and block-wise FP8, which
   dequantizes per call on the CPU). Rounds alternate the kernels; the ratio is each one's median time over bf16's.
2. Tiny checkpoints (epd_builders/quantize.py at group / block 32): the LM's bytes and greedy decode tokens/s at one
   row, kept quantized against dequantized, for the Qwen3-VL-MoE FP8 layout (FP8 experts) and Qwen2.5-VL AWQ.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from epd_models.quant.forms import Fp8Weight, Int4Weight
from epd_models.quant.linear import Fp8Linear, Int4Linear

SHAPES = {"mlp up 3584->18944": (18944, 3584), "attention out 3584->3584": (3584, 3584)}
ROWS = (1, 16)
GROUP, BLOCK = 128, 128


def _forms(out: int, inn: int) -> dict[str, torch.nn.Module]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inn, generator=g) * 0.02
    q4 = torch.randint(0, 16, (out, inn), generator=g, dtype=torch.uint8)
    scale = torch.rand(out, inn // GROUP, generator=g) * 0.01 + 0.001
    int4 = Int4Weight(q4, scale, torch.full_like(scale, 8.0), torch.arange(inn) // GROUP, GROUP)
    q8 = (w / 0.001).clamp(-448, 448).to(torch.float8_e4m3fn)
    channel = Fp8Weight(q8, torch.full((out, 1), 0.001), (1, inn))
    block = Fp8Weight(q8, torch.full((-(-out // BLOCK), -(-inn // BLOCK)), 0.001), (BLOCK, BLOCK))
    dense = torch.nn.Linear(inn, out, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(w)
    cpu = torch.device("cpu")
    return {"bf16 F.linear (dequantized)": dense, "int4 tinygemm (kept)": Int4Linear(int4, None, cpu),
            "fp8 per-channel _scaled_mm (kept)": Fp8Linear(channel, None),
            "fp8 block-wise (kept; per-call dequantize on CPU)": Fp8Linear(block, None)}


def _call(mod: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    return lambda: mod(x)


def _time(fn: Callable[[], object], repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


@torch.inference_mode()
def kernels(rounds: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for label, (out, inn) in SHAPES.items():
        mods = _forms(out, inn)
        for m in ROWS:
            x = torch.randn(m, inn, dtype=torch.bfloat16)
            times: dict[str, list[float]] = {name: [] for name in mods}
            for _ in range(rounds):  # alternate: a busy machine slows all alike
                for name, mod in mods.items():
                    times[name].append(_time(_call(mod, x), 5))
            base = statistics.median(times["bf16 F.linear (dequantized)"])
            for name, ts in times.items():
                held = sum(t.numel() * t.element_size() for t in (*mods[name].parameters(), *mods[name].buffers()))
                rows.append({"shape": label, "rows": m, "kernel": name, "ms": round(statistics.median(ts) * 1e3, 3),
                             "time_vs_bf16": round(statistics.median(ts) / base, 2), "weight_MiB": round(held / 2**20, 1)})
    return rows


@torch.inference_mode()
def tiny_models(root: Path, tokens: int = 48) -> list[dict[str, object]]:
    from decoder_service.engine.memory_plan import module_bytes
    from decoder_service.generate import generate
    from decoder_service.prompt import build_prompt
    from epd_builders.quantize import build_quantized
    from epd_builders.tiny import TinySpec, build_tiny
    from epd_models.halves import LanguageHalf

    rows: list[dict[str, object]] = []
    for family, fmt in (("qwen3_vl_moe", "fp8"), ("qwen2_5_vl", "awq")):
        src = build_tiny(TinySpec(family=family, text_hidden=128, lm_scale=3.0), root / family)
        out, twin = root / f"{family}-{fmt}", root / f"{family}-{fmt}-twin"
        build_quantized(src, fmt, out, twin, group_size=32)
        for mode in ("keep", "dequantize"):
            lm = LanguageHalf(out, quantized=mode)
            prompt = build_prompt(lm, lm.tokenizer("describe the picture").input_ids, [])
            start = time.perf_counter()
            made = list(generate(lm, prompt, lambda x: int(torch.argmax(x)), tokens, eos_ids=set()))
            rows.append({"model": f"tiny {family} {fmt}", "weights": mode, "lm_bytes": module_bytes(lm.module),
                         "layers_bytes": module_bytes(lm.module.language_model.layers),
                         "tokens_per_s": round(len(made) / (time.perf_counter() - start), 1)})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epd_bench.quant_cpu", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of the kernels")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown tables")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = {"kernels": kernels(args.rounds), "tiny": tiny_models(Path(tmp))}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for rows in report.values():
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        for row in rows:
            print("| " + " | ".join(str(row[k]) for k in keys) + " |")
        print()


if __name__ == "__main__":
    main()
