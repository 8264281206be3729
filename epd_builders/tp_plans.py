"""Start-up plans per rank for tensor parallelism (`--tensor-parallel-size`, the split epd_models/tensor_parallel.py
makes): the real-size checkpoints of epd_builders/quant_plans.py (and Qwen2.5-VL-72B in bf16) split over N devices,
one rank each. Per rank: the weight bytes it holds, the K/V blocks and max model length the decoder's own plan
(decoder_service/engine/memory_plan.py) gives its share of the pool, or why that N is refused.

    python -m epd_builders.tp_plans [--json] [--devices-gib 80 141] [--tp 2 4 8]

The split this plans (vLLM's, Megatron's): in every decoder layer, q/k/v_proj and gate/up_proj are column-parallel
(each rank holds 1/N of the output rows: its attention heads, its K/V heads, its MLP slice), o_proj and down_proj
row-parallel (1/N of the input columns; the partial outputs are summed by an all-reduce); an MoE's experts split each
expert's intermediate width the same way (gate_up column-, down row-parallel); embeddings, lm_head, norms and the
router are replicated on every rank (a vocabulary-parallel lm_head would save 2 x vocab x hidden x 2 B x (N-1)/N per
rank: 2.3 GiB at 72B, TP 8). A row-parallel bias is held by one rank; the planned number is the largest rank's.

Refused, with the numbers:
  - K/V heads that N does not divide (each rank holds whole K/V heads of its own; vLLM replicates them instead when
    N > K/V heads: EPD refuses, so no K/V head is held twice);
  - a split that cuts a quantization block or group: an FP8 block (128 x 128) must not straddle two ranks, so the
    split dimension / N is a multiple of 128; int4 groups (128 along the input) likewise on a row-parallel split,
    and AWQ's 8 packed columns on a column-parallel one;
  - weights over 0.9 x the device on a rank, or no K/V block left (the plan's KVPlanError).
tests/bench/test_tp_plans.py checks the per-rank bytes against the one-device count of quant_plans.py.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.memory_plan import KVPlanError, plan_kv_cache
from epd_builders.quant_plans import BF16, BLOCK_SIZE, GIB, MODELS, UTILIZATION, QuantModel
from epd_models.quant.forms import fp8_bytes, int4_bytes
from epd_models.registry import adapter_for

DEVICES_GIB = (80, 141)
TP_SIZES = (2, 4, 8)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
AWQ_PACK = 8  # int4 values per int32 along the output columns
_72B = next(m for m in MODELS if m.name == "Qwen/Qwen2.5-VL-72B-Instruct-AWQ")
TP_MODELS = (replace(_72B, name="Qwen/Qwen2.5-VL-72B-Instruct", method="bf16"), _72B,
             next(m for m in MODELS if m.name == "Qwen/Qwen3-VL-235B-A22B-Instruct-FP8"))


@dataclass(frozen=True)
class RankHeld:
    weight_bytes: int  # the largest rank's
    refusals: tuple[str, ...]  # splits N cannot make (each names the tensor and the numbers)


def _linear_bytes(model: QuantModel, out: int, inn: int) -> int:
    if model.method == "fp8":
        return fp8_bytes(out, inn, model.block)
    if model.method == "bf16":
        return out * inn * BF16
    return int4_bytes(out, inn, model.group)


def _split_refusal(model: QuantModel, name: str, dim: str, size: int, tp: int) -> str | None:
    """Why `size` (the split dimension, 'out' for column-, 'in' for row-parallel) cannot be cut in `tp` parts."""
    if size % tp:
        return f"{name}: {dim} {size} is not divisible by {tp}"
    part = size // tp
    if model.method == "fp8":
        block = model.block[0] if dim == "out" else model.block[1]
        if part % block:
            return f"{name}: {dim} {size} / {tp} = {part} cuts an FP8 block of {block}"
    elif model.method != "bf16":
        unit = AWQ_PACK if dim == "out" else model.group
        if part % unit:
            what = "packed int4 columns of 8" if dim == "out" else f"an int4 group of {model.group}"
            return f"{name}: {dim} {size} / {tp} = {part} cuts {what}"
    return None


def rank_held(model: QuantModel, tp: int, cfg: Any = None) -> RankHeld:
    """The decoder's LM on meta, walked: split tensors at 1/tp (after checking the split), the rest whole."""
    cfg = cfg or model.config()
    lm = adapter_for(cfg).build_language(cfg)
    total = 0
    refusals: dict[str, str] = {}  # one per projection kind (every layer says the same)

    def refuse(kind: str, why: str | None) -> None:
        if why is not None:
            refusals.setdefault(kind, why)

    for name, module in lm.named_modules():
        own = dict(module.named_parameters(recurse=False))
        leaf = name.rsplit(".", 1)[-1]
        in_layers = ".layers." in f".{name}"
        if in_layers and isinstance(module, nn.Linear) and leaf in COLUMN + ROW:
            out, inn = module.weight.shape
            column = leaf in COLUMN
            refuse(leaf, _split_refusal(model, name, "out" if column else "in", out if column else inn, tp))
            total += _linear_bytes(model, out // tp, inn) if column else _linear_bytes(model, out, inn // tp)
            own.pop("weight")
            bias = own.pop("bias", None)
            if bias is not None:
                total += bias.numel() // (tp if column else 1) * BF16
        elif in_layers and "gate_up_proj" in own:
            experts, rows, hidden = own.pop("gate_up_proj").shape  # (experts, 2 x intermediate, hidden)
            assert own.pop("down_proj").shape == (experts, hidden, rows // 2)
            inter = rows // 2  # gate's rows, then up's
            refuse("experts", _split_refusal(model, f"{name}.gate_up_proj", "out", inter, tp))
            refuse("experts", _split_refusal(model, f"{name}.down_proj", "in", inter, tp))
            total += experts * (2 * _linear_bytes(model, inter // tp, hidden) + _linear_bytes(model, hidden, inter // tp))
        total += sum(p.numel() for p in own.values()) * BF16
    return RankHeld(total, tuple(refusals.values()))


def plan_row(model: QuantModel, tp: int, device_gib: int, held: RankHeld, text: Any) -> dict[str, Any]:
    total = device_gib * GIB
    budget = int(total * UTILIZATION)
    full = KVShape.of(text, torch.bfloat16)
    row: dict[str, Any] = {"model": model.name, "tp": tp, "device_gib": device_gib,
                           "rank_weight_bytes": held.weight_bytes, "budget_bytes": budget}
    refusals = list(held.refusals)
    if full.kv_heads % tp:
        refusals.append(f"{full.kv_heads} K/V heads are not divisible by {tp} (each rank holds whole K/V heads)")
    if held.weight_bytes > budget:
        refusals.append(f"weights per rank ({held.weight_bytes / GIB:.1f} GiB) exceed {UTILIZATION:g} x {device_gib} "
                        f"GiB = {budget / GIB:.1f} GiB")
    if refusals:
        return {**row, "refused": "; ".join(refusals)}
    shape = replace(full, kv_heads=full.kv_heads // tp)
    try:
        plan = plan_kv_cache(shape, block_size=BLOCK_SIZE, requested_max_len=0,
                             checkpoint_max_len=int(text.max_position_embeddings), kv_cache_memory=0,
                             device=torch.device("cuda"), gpu_memory_utilization=UTILIZATION, total_bytes=total,
                             used_bytes=held.weight_bytes)
    except KVPlanError as exc:
        return {**row, "refused": f"KVPlanError: {exc}"}
    return {**row, "refused": None, "rank_bytes_per_token": plan.bytes_per_token, "num_blocks": plan.num_blocks,
            "max_model_len": plan.max_model_len, "checkpoint_max_len": int(text.max_position_embeddings)}


def plans(devices_gib: tuple[int, ...] = DEVICES_GIB, tp_sizes: tuple[int, ...] = TP_SIZES,
          models: tuple[QuantModel, ...] = TP_MODELS) -> list[dict[str, Any]]:
    out = []
    for model in models:
        cfg = model.config()
        for tp in tp_sizes:
            held = rank_held(model, tp, cfg)
            out += [plan_row(model, tp, gib, held, cfg.get_text_config()) for gib in devices_gib]
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | TP | device (GiB) | weights per rank (GiB) | K/V KiB/token per rank | K/V blocks of 16 "
             "| max model len | note |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["refused"]:
            cells = ["–", "–", "–", f"**refused**: {r['refused']}"]
        else:
            note = "" if r["max_model_len"] == r["checkpoint_max_len"] else f"lowered from {r['checkpoint_max_len']:,}"
            cells = [f"{r['rank_bytes_per_token'] / 1024:g}", f"{r['num_blocks']:,}", f"{r['max_model_len']:,}", note]
        lines.append(f"| {r['model']} | {r['tp']} | {r['device_gib']} | {r['rank_weight_bytes'] / GIB:.2f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "`python -m epd_builders.tp_plans` (the split and the refusals: its docstring)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epd_builders.tp_plans", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a Markdown table")
    p.add_argument("--devices-gib", type=int, nargs="+", default=list(DEVICES_GIB), help="device sizes in GiB")
    p.add_argument("--tp", type=int, nargs="+", default=list(TP_SIZES), help="tensor-parallel sizes")
    args = p.parse_args(argv)
    rows = plans(tuple(args.devices_gib), tuple(args.tp))
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))


if __name__ == "__main__":
    main()
