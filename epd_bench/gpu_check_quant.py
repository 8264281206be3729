"""Quantized weights on the device at real shapes: what `make gpu-check` records per format, and MoE experts.

    python -m epd_bench.gpu_check_quant --format fp8|awq --model DIR --out DIR [--device cuda] [--steps 32] --json
    python -m epd_bench.gpu_check_quant --format moe --out DIR [--device cuda] [--size full|small] --json

fp8 / awq: DIR (gpu-check's random Qwen2.5-VL-3B of real shapes, bf16) is quantized by epd_builders/quantize.py's
`build_quantized` (FP8 blocks of --group-size squared; AWQ GEMM int4, group --group-size; 128 by default, 32 in the
small dry run) into --out, then its LM is loaded twice:
  - `LanguageHalf(..., quantized="dequantize")` first (the reference: every weight dequantized to the compute dtype,
    so its bytes are the bf16 model's): greedy tokens of one prompt over --parity-steps steps on an eager runner,
    and the first step's logits; then it is freed;
  - `quantized="keep"`: the bytes held on the device (module_bytes; on CUDA also the allocator's growth during the
    load) ÷ the reference's, then gpu_check_engine's measurement on it (K/V plan, decode CUDA graphs, TPOT at
    batch 1 ÷ the HBM bound of the bytes held, tokens/s at 64 rows), then the same greedy decode on that runner
    (graphs replayed on CUDA), and which kernel each quantized module ran (`module.kernel`: scaled_mm,
    scaled_mm_blockwise, dequantize_per_call, weight_int4pack_mm[_for_cpu], fp8_experts' inner path).
  Parity: tokens equal before the first difference, and max |logit diff| ÷ max |logit| of the reference at the
  first step (random weights: the logits are small and near-ties common, so a token difference can come early).
moe: a Qwen3-VL-MoE of 3 layers with Qwen3-VL-30B-A3B's layer shapes (MOE_TEXT; `--size small`: 8 experts at width
  64), random weights in bf16 on CUDA, decoding with transformers' experts implementations "eager" (a loop over the experts hit) and
  "grouped_mm" (one grouped GEMM; torch's CPU fallback off CUDA), set on the config the experts modules read
  (`config._experts_implementation`): tokens equal, and tokens/s at 64 rows (eager runner, no graphs) of each.
`run_quant` adds these as gpu-check steps quant-fp8, quant-awq and quant-moe, each under LIMIT_S and started only
with MIN_LEFT_S of the run's budget left (skipped with the reason otherwise). Not yet timed on a GPU: LIMIT_S is an
estimate (build_quantized took 1.6 s (fp8) and 2.2 s (awq) per 22.5M weights on 2 host cores; the 3B's decoder
layers hold 2.8B, so 15-40 s on 16 cores, plus writing the quantized checkpoint and its twin).
"""
from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epd_bench.gpu_check_engine import PROMPT_TOKENS, ROWS, block_size, measure_lm, timed_decode
from epd_bench.micro import emit, parser

if TYPE_CHECKING:
    import torch

    from decoder_service.engine.model_runner import ModelRunner
    from epd_bench.gpu_check_run import Run
    from epd_models.halves import LanguageHalf

FAMILY = "qwen2.5-vl-3b"  # the gpu-check build the formats are made from
STEPS = ("fp8", "awq", "moe")
LIMIT_S = 150.0  # one step (a 3B quantized on the host's cores, then loaded twice and measured)
MIN_LEFT_S = 90.0  # of the run's budget, for a step to start (--size full)
PARITY_STEPS = 32


def run_quant(run: Run, model_dir: Path | None) -> None:
    """gpu-check's steps quant-fp8, quant-awq, quant-moe (each in a process of its own on --device)."""
    small = run.args.size == "small"
    for fmt in STEPS:
        name = f"quant-{fmt}"
        if model_dir is None and fmt != "moe":
            run.skip(name, f"no {FAMILY} checkpoint was built")
            continue
        if run.short_of(MIN_LEFT_S):
            run.skip(name, f"{run.left():.0f} s of the budget left, fewer than {MIN_LEFT_S:.0f}")
            continue
        with run.step(name, f"{name}.log") as rec:
            args = ["-m", "epd_bench.gpu_check_quant", "--format", fmt, "--device", run.args.device, "--out",
                    str(run.scratch / name), "--size", run.args.size, "--json",
                    *(("--model", str(model_dir)) if fmt != "moe" else ()), *(("--steps", "4") if small else ()),
                    *(("--group-size", "32") if small and fmt != "moe" else ())]  # 32: the small widths are 64
            text = run.python(rec, f"{name}.log", args, LIMIT_S)
            rec["result"] = json.loads(text.strip().splitlines()[-1])


def greedy(runner: ModelRunner, lm: LanguageHalf, steps: int, seed: int = 7) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of one random prompt over `steps` steps, and the first step's logits (float32, CPU)."""
    import torch

    from decoder_service.prompt import Prompt

    # ids the tokenizer has: the random builds zero the embedding / lm_head rows past it (tied in Qwen2.5-VL-3B)
    vocab = min(lm.config.get_text_config().vocab_size, len(lm.tokenizer))
    ids = torch.randint(10, vocab - 10, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed))
    key: Hashable = ("greedy", seed)
    runner.add(key, Prompt(ids, []))
    first = runner.prefill(1 << 30)[key].float().cpu()
    tokens, logits = [int(first.argmax())], first
    for _ in range(steps - 1):
        feed = {key: tokens[-1]}
        runner.grow(feed)
        logits = runner.decode(feed)[key]
        tokens.append(int(logits.argmax()))
    runner.remove(key)
    return tokens, first


def parity(ref: tuple[list[int], torch.Tensor], got: tuple[list[int], torch.Tensor]) -> dict[str, Any]:
    same = next((i for i, (a, b) in enumerate(zip(ref[0], got[0], strict=True)) if a != b), len(ref[0]))
    scale = float(ref[1].abs().max())
    diff = float((ref[1] - got[1]).abs().max())
    return {"steps": len(ref[0]), "tokens_equal_before_first_difference": same, "tokens_equal": same == len(ref[0]),
            "max_abs_logit_diff": diff, "logit_scale": scale, "diff_over_scale": diff / scale if scale else None}


def _allocated(device: torch.device) -> int | None:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _load(path: Path, device: str, mode: str) -> tuple[LanguageHalf, dict[str, Any]]:
    import torch

    from decoder_service.engine.memory_plan import module_bytes
    from epd_models.halves import LanguageHalf

    dev = torch.device(device)
    before, started = _allocated(dev), time.monotonic()
    lm = LanguageHalf(path, device=device, quantized=mode)
    after = _allocated(lm.device)
    return lm, {"weight_bytes": module_bytes(lm.module), "load_s": round(time.monotonic() - started, 1),
                "allocated_bytes": None if after is None or before is None else after - before,
                "summary": lm.quant.summary()}


def kernels(lm: LanguageHalf) -> dict[str, int]:
    """Quantized modules by the kernel their last call ran ("unset": never called)."""
    found = (getattr(m, "kernel", None) for m in lm.module.modules())
    return dict(Counter(k for k in found if isinstance(k, str)))


def measure_format(model: Path, fmt: str, device: str, out: Path, group: int, steps: int, parity_steps: int,
                   hbm_gbps: float | None) -> dict[str, Any]:
    import gc

    import torch

    from decoder_service.engine.model_runner import ModelRunner
    from epd_builders.quantize import build_quantized

    started = time.monotonic()
    shutil.rmtree(out, ignore_errors=True)
    build_quantized(model, fmt, out / "quantized", out / "twin", group)
    shutil.rmtree(out / "twin", ignore_errors=True)  # not served here: the dequantize mode is the reference
    result: dict[str, Any] = {"format": fmt, "build_s": round(time.monotonic() - started, 1)}
    deq, result["dequantized"] = _load(out / "quantized", device, "dequantize")
    per_row = -(-(PROMPT_TOKENS + parity_steps + 4) // block_size(deq.device))
    ref_runner = ModelRunner(deq, 1, PROMPT_TOKENS + parity_steps + 8, chunk=1 << 30,
                             prefix_block=block_size(deq.device), num_blocks=per_row + 1)
    ref = greedy(ref_runner, deq, parity_steps)
    del ref_runner, deq
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    kept, result["kept"] = _load(out / "quantized", device, "keep")
    result["scheme"] = result["kept"]["summary"]["format"]  # e.g. "fp8 (fp8-block block 128x128)", "awq (awq, group 128)"
    result["engine"], runner = measure_lm(kept, steps, hbm_gbps)
    result["parity"] = parity(ref, greedy(runner, kept, parity_steps))
    result["kernels"] = kernels(kept)
    held, bf16 = result["kept"], result["dequantized"]
    result["kept_over_bf16_bytes"] = round(held["weight_bytes"] / bf16["weight_bytes"], 3)
    if held["allocated_bytes"] and bf16["allocated_bytes"]:  # CUDA: what the allocator grew by during each load
        result["kept_over_bf16_allocated"] = round(held["allocated_bytes"] / bf16["allocated_bytes"], 3)
    return result


# the MoE layers measured: Qwen3-VL-30B-A3B's (its hub config.json: hidden 2048, 32 heads, 4 K/V heads, head_dim 128,
# 128 experts, 8 per token, moe_intermediate 768) on the tiny family's 3 layers; small: 8 experts of 48 at width 64
MOE_TEXT = {"full": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, mrope=[24, 20, 20]),
            "small": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, mrope=[2, 3, 3])}


def moe_checkpoint(out: Path, size: str, device: str) -> Path:
    """The tiny Qwen3-VL-MoE (epd_builders/tiny.py: its tokenizer, processor, 3 sparse layers) with its text layers
    reshaped to MOE_TEXT[size], weights drawn on `device` (bf16 on CUDA) by full_size.random_model, saved over it."""
    from transformers import AutoConfig

    from epd_builders.full_size import random_model
    from epd_builders.tiny import TinySpec, build_tiny

    path = build_tiny(TinySpec(family="qwen3_vl_moe"), out / "moe")
    cfg = AutoConfig.from_pretrained(path)
    shape = dict(MOE_TEXT[size])
    cfg.text_config.rope_parameters["mrope_section"] = shape.pop("mrope")
    for key, value in shape.items():
        setattr(cfg.text_config, key, value)
    cfg.vision_config.out_hidden_size = cfg.text_config.hidden_size
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    cfg.dtype = cfg.text_config.dtype = cfg.vision_config.dtype = dtype
    random_model(cfg, 0.02, device).save_pretrained(path)
    return path


def measure_moe(device: str, out: Path, size: str, steps: int, parity_steps: int) -> dict[str, Any]:
    from decoder_service.engine.model_runner import ModelRunner
    from epd_models.halves import LanguageHalf

    lm = LanguageHalf(moe_checkpoint(out, size, device), device=device)
    text = lm.config.get_text_config()
    need = ROWS * -(-(PROMPT_TOKENS + max(steps, parity_steps) + 4) // block_size(lm.device)) + 1
    runner = ModelRunner(lm, ROWS, PROMPT_TOKENS + max(steps, parity_steps) + 8, chunk=1 << 30,
                         prefix_block=block_size(lm.device), num_blocks=need)
    experts = [m for m in lm.module.modules() if "Experts" in type(m).__name__ and hasattr(m, "config")]
    configs: dict[int, Any] = {id(m.config): m.config for m in experts}  # what the experts' forward reads
    result: dict[str, Any] = {"device": str(lm.device), "dtype": str(lm.dtype).removeprefix("torch."),
                              "experts_modules": len(experts), "hidden": text.hidden_size,
                              "experts": text.num_experts, "per_token": text.num_experts_per_tok,
                              "moe_intermediate": text.moe_intermediate_size,
                              "default": sorted({c._experts_implementation for c in configs.values()})}
    runs = {}
    for impl in ("eager", "grouped_mm"):
        for cfg in configs.values():
            cfg._experts_implementation = impl
        tokens, first = greedy(runner, lm, parity_steps)
        runs[impl] = (tokens, first)
        result[f"{impl}_tokens_per_s_{ROWS}"] = round(ROWS / timed_decode(runner, lm, ROWS, steps), 1)
    result["parity"] = parity(runs["eager"], runs["grouped_mm"])
    result["grouped_over_eager"] = round(result[f"grouped_mm_tokens_per_s_{ROWS}"] /
                                         result[f"eager_tokens_per_s_{ROWS}"], 2)
    return result


def main(argv: list[str] | None = None) -> None:
    p = parser("gpu_check_quant", __doc__, "print the result as one JSON line")
    p.add_argument("--format", choices=STEPS, required=True)
    p.add_argument("--model", type=Path, default=None, help="the bf16 checkpoint to quantize (fp8, awq)")
    p.add_argument("--out", type=Path, required=True, help="a scratch folder for the checkpoints built")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    p.add_argument("--size", choices=("full", "small"), default="full", help="moe: the model's size")
    p.add_argument("--group-size", type=int, default=128, help="awq's group (default: %(default)s)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per number (default: %(default)s)")
    p.add_argument("--parity-steps", type=int, default=PARITY_STEPS, help="greedy steps compared")
    p.add_argument("--hbm-gbps", type=float, default=None, help="HBM bandwidth for devices gpu_check_engine lacks")
    args = p.parse_args(argv)
    if args.format != "moe" and args.model is None:
        p.error(f"--format {args.format} needs --model")
    import torch

    with torch.inference_mode():
        if args.format == "moe":
            result = measure_moe(args.device, args.out, args.size, args.steps, args.parity_steps)
        else:
            result = measure_format(args.model, args.format, args.device, args.out, args.group_size, args.steps,
                                    args.parity_steps, args.hbm_gbps)
    emit(result, True, indent=None if args.json else 1)


if __name__ == "__main__":
    main()
