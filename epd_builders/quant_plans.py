"""Start-up plans for real-size quantized checkpoints on one device: the decoder's weight bytes as held, and the K/V
pool and max model length the decoder's own plan (decoder_service/engine/memory_plan.py) gives them, or its refusal.

    python -m epd_builders.quant_plans [--json] [--devices-gib 24 80 141]

Nothing is downloaded and no weight is drawn: each model's config is built from transformers' classes, the decoder's
LM (embeddings, decoder layers, final norm, lm_head: what `LanguageHalf` builds, via the family adapter's
`build_language`) and the vision tower are built with their parameters on meta, and every module is walked:
  - the decoder-layer projections the checkpoint quantizes (q/k/v/o_proj, gate/up/down_proj: epd_builders/quantize.py's
    PROJECTIONS) count as held quantized: `fp8_bytes(out, in, block)` or `int4_bytes(out, in, group)`
    (epd_models/quant/forms.py); an FP8 checkpoint's MoE experts count as FP8 per expert and projection (the FP8
    experts module keeps them so); the MoE router (`mlp.gate`) stays bf16, as the FP8 releases leave it;
  - everything else (embeddings, lm_head, norms, biases, routers) at 2 bytes (bf16);
  - the vision tower is NOT on the decoder (it runs in the encoder process): its parameters are counted for the
    total only.
K/V: bf16 at KVShape.of(text config), block 16, `plan_kv_cache` at --gpu-memory-utilization 0.9 with used_bytes =
the weights. Activations (the profiling forward's peak, CUDA graphs, the allocator's reserve) are extra, so a real
start-up gets fewer blocks than this plan; a device's usable total is also a little under its nominal size
(torch.cuda.mem_get_info: about 79.2 GiB on an H100 80 GB, 139.8 GiB on an H200). Refused: weights alone over
0.9 x the device (then the plan's own KVPlanError too), or no K/V block left.

Where the numbers come from (hub config.json of each repository as published; transformers 5.24's classes):
  Qwen/Qwen3-VL-30B-A3B-Instruct-FP8: text_config hidden 2048, 48 layers, 32 heads, 4 K/V heads, head_dim 128,
    128 experts, 8 per token, moe_intermediate 768, every layer sparse (decoder_sparse_step 1, no mlp_only_layers),
    vocab 151936, 262144 positions, untied lm_head; quantization_config fp8, weight_block_size [128, 128], dynamic
    activations, lm_head / routers / visual not converted. vision_config: depth 27, hidden 1152, MLP 4304, 16 heads,
    patch 16, DeepStack at [8, 16, 24] (the hub's vision_config, also Qwen3VLMoeVisionConfig's defaults),
    out_hidden 2048.
  Qwen/Qwen3-VL-235B-A22B-Instruct-FP8: the same with hidden 4096, 94 layers, 64 heads, 4 K/V heads, head_dim 128,
    moe_intermediate 1536; vision out_hidden 4096.
  Qwen/Qwen2.5-VL-7B-Instruct-AWQ: hidden 3584, 28 layers, 28 heads, 4 K/V heads, MLP 18944, vocab 152064, 128000
    positions, untied; quantization_config awq GEMM, 4 bits, group 128, zero points, visual not converted. Tower:
    depth 32, hidden 1280, MLP 3420, 16 heads, patch 14, window 112 (the hub's vision_config), out_hidden 3584.
  Qwen/Qwen2.5-VL-72B-Instruct-AWQ: hidden 8192, 80 layers, 64 heads, 8 K/V heads, MLP 29568, vocab 152064, 128000
    positions, untied, group 128; tower out_hidden 8192. (Not checked against the AWQ repository's own config.json:
    Qwen's int4 releases of Qwen2-72B pad the MLP to 29696, 232 groups, so it shards 8 ways; if this one does too,
    its held bytes are about 0.3 % more than here.)
tests/bench/test_quant_plans.py checks the parameter totals against the counts the hub publishes and the weight
bytes against an estimate from those counts.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig, Qwen2_5_VLConfig, Qwen3VLMoeConfig
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLVisionConfig
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig, Qwen3VLMoeVisionConfig

from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.memory_plan import KVPlanError, plan_kv_cache
from epd_builders.quantize import PROJECTIONS
from epd_models.meta import params_on_meta
from epd_models.quant.forms import fp8_bytes, int4_bytes
from epd_models.registry import adapter_for

GIB = 1 << 30
DEVICES_GIB = (24, 80, 141)
UTILIZATION = 0.9
BLOCK_SIZE = 16
BF16 = 2


@dataclass(frozen=True)
class QuantModel:
    name: str  # the hub repository
    family: str  # "qwen3_vl_moe" or "qwen2_5_vl"
    method: str  # "fp8" (block) or "awq" (int4 per group)
    text: dict[str, Any]
    vision: dict[str, Any]
    block: tuple[int, int] = (128, 128)
    group: int = 128

    def config(self) -> PretrainedConfig:
        """The composite config (the text config inside is what the decoder builds and plans from)."""
        text: Any
        vision: Any
        if self.family == "qwen3_vl_moe":
            text = Qwen3VLMoeTextConfig(**self.text, head_dim=128, decoder_sparse_step=1, mlp_only_layers=[],
                                        tie_word_embeddings=False, dtype="bfloat16")
            vision = Qwen3VLMoeVisionConfig(**self.vision, out_hidden_size=self.text["hidden_size"])
            composite: Any = Qwen3VLMoeConfig
        else:
            text = Qwen2_5_VLTextConfig(**self.text, dtype="bfloat16")
            vision = Qwen2_5_VLVisionConfig(**self.vision, out_hidden_size=self.text["hidden_size"])
            composite = Qwen2_5_VLConfig
        cfg: PretrainedConfig = composite(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                          tie_word_embeddings=False)  # every one of the four: an lm_head of its own
        cfg.dtype = "bfloat16"
        return cfg


_MOE = dict(num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=262144)
_QWEN25 = dict(vocab_size=152064, max_position_embeddings=128000)
# the towers as published (set here, not left to the classes' defaults: Qwen2_5_VLVisionConfig's hidden_size
# default is 3584, the 7B LM's width, not the tower's 1280)
_QWEN3_TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                    deepstack_visual_indexes=[8, 16, 24])
_QWEN25_TOWER = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                     window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
MODELS = (
    QuantModel("Qwen/Qwen3-VL-30B-A3B-Instruct-FP8", "qwen3_vl_moe", "fp8",
               dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                    intermediate_size=6144, moe_intermediate_size=768, **_MOE), _QWEN3_TOWER),
    QuantModel("Qwen/Qwen2.5-VL-7B-Instruct-AWQ", "qwen2_5_vl", "awq",
               dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                    intermediate_size=18944, **_QWEN25), _QWEN25_TOWER),
    QuantModel("Qwen/Qwen2.5-VL-72B-Instruct-AWQ", "qwen2_5_vl", "awq",
               dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                    intermediate_size=29568, **_QWEN25), _QWEN25_TOWER),
    QuantModel("Qwen/Qwen3-VL-235B-A22B-Instruct-FP8", "qwen3_vl_moe", "fp8",
               dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                    intermediate_size=12288, moe_intermediate_size=1536, **_MOE), _QWEN3_TOWER),
)


@dataclass(frozen=True)
class Held:
    """What the decoder holds for one model, counted module by module."""

    decoder_params: int
    vision_params: int
    quantized_params: int  # weights of the linears / experts held quantized
    quantized_bytes: int
    bf16_bytes: int  # everything else on the decoder

    @property
    def weight_bytes(self) -> int:
        return self.quantized_bytes + self.bf16_bytes

    @property
    def total_params(self) -> int:
        return self.decoder_params + self.vision_params


def held_bytes(model: QuantModel, cfg: PretrainedConfig | None = None) -> Held:
    """Walk the decoder's LM built on meta: quantized projections and experts at their held bytes, the rest bf16."""
    cfg = cfg or model.config()
    lm = adapter_for(cfg).build_language(cfg)
    with params_on_meta():
        vision = AutoModel.from_config(cfg.vision_config)
    q_params = q_bytes = rest = 0
    for name, module in lm.named_modules():
        own = dict(module.named_parameters(recurse=False))
        leaf = name.rsplit(".", 1)[-1]
        in_layers = ".layers." in f".{name}"
        if in_layers and isinstance(module, nn.Linear) and leaf in PROJECTIONS:
            out, inn = module.weight.shape
            q_params += out * inn
            q_bytes += _quantized(model, out, inn)
            own.pop("weight")
        elif in_layers and "gate_up_proj" in own and model.method == "fp8":
            for fused in ("gate_up_proj", "down_proj"):
                param = own.pop(fused)
                q_params += param.numel()
                q_bytes += _experts(model, fused, param)
        rest += sum(p.numel() for p in own.values()) * BF16
    params = sum(p.numel() for p in {id(p): p for p in lm.parameters()}.values())
    return Held(params, sum(p.numel() for p in vision.parameters()), q_params, q_bytes, rest)


def _quantized(model: QuantModel, out: int, inn: int) -> int:
    return fp8_bytes(out, inn, model.block) if model.method == "fp8" else int4_bytes(out, inn, model.group)


def _experts(model: QuantModel, name: str, fused: torch.Tensor) -> int:
    """A fused (experts, out, in) tensor as the FP8 checkpoint holds it: one FP8 weight per expert and projection
    (gate_up_proj stacks gate's and up's rows: two linears of out / 2 rows each; down_proj is one)."""
    experts, out, inn = fused.shape
    rows = [out // 2, out // 2] if name == "gate_up_proj" else [out]
    return experts * sum(fp8_bytes(r, inn, model.block) for r in rows)


def plan_row(model: QuantModel, held: Held, text: Any, device_gib: int) -> dict[str, Any]:
    """One device size: the plan's blocks and length, or why the decoder is refused (with the numbers)."""
    total = device_gib * GIB
    budget = int(total * UTILIZATION)
    row: dict[str, Any] = {"model": model.name, "device_gib": device_gib, "weight_bytes": held.weight_bytes,
                           "budget_bytes": budget}
    refusals = []
    if held.weight_bytes > budget:
        need = -(-held.weight_bytes // budget)
        refusals.append(f"weights alone ({held.weight_bytes / GIB:.1f} GiB) exceed {UTILIZATION:g} x {device_gib} GiB "
                        f"= {budget / GIB:.1f} GiB: needs tensor parallelism (at least {need} devices of this size "
                        "for the weights alone)")
    try:
        plan = plan_kv_cache(KVShape.of(text, torch.bfloat16), block_size=BLOCK_SIZE, requested_max_len=0,
                             checkpoint_max_len=int(text.max_position_embeddings), kv_cache_memory=0,
                             device=torch.device("cuda"), gpu_memory_utilization=UTILIZATION, total_bytes=total,
                             used_bytes=held.weight_bytes)
    except KVPlanError as exc:
        refusals.append(f"KVPlanError: {exc}")
        return {**row, "refused": "; ".join(refusals)}
    return {**row, "refused": "; ".join(refusals) or None, "bytes_per_token": plan.bytes_per_token,
            "pool_bytes": plan.pool_bytes, "num_blocks": plan.num_blocks, "max_tokens": plan.max_tokens,
            "max_model_len": plan.max_model_len, "checkpoint_max_len": int(text.max_position_embeddings)}


def plans(devices_gib: tuple[int, ...] = DEVICES_GIB, models: tuple[QuantModel, ...] = MODELS) -> list[dict[str, Any]]:
    """Per model: its counts and one plan row per device size."""
    out = []
    for model in models:
        cfg = model.config()
        held = held_bytes(model, cfg)
        out.append({"model": model.name, "method": model.method, "decoder_params": held.decoder_params,
                    "vision_params": held.vision_params, "total_params": held.total_params,
                    "quantized_params": held.quantized_params, "quantized_bytes": held.quantized_bytes,
                    "bf16_bytes": held.bf16_bytes, "weight_bytes": held.weight_bytes,
                    "rows": [plan_row(model, held, cfg.get_text_config(), gib) for gib in devices_gib]})
    return out


def markdown(result: list[dict[str, Any]]) -> str:
    lines = ["| model | params (decoder + vision) | decoder weights held (GiB) | device (GiB) | K/V KiB/token "
             "| K/V blocks of 16 | max model len | note |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for m in result:
        params = f"{m['decoder_params'] / 1e9:.2f}B + {m['vision_params'] / 1e9:.2f}B"
        for r in m["rows"]:
            if "num_blocks" in r:
                len_note = "" if r["max_model_len"] == r["checkpoint_max_len"] else \
                    f"lowered from {r['checkpoint_max_len']:,}"
                cells = [f"{r['bytes_per_token'] / 1024:g}", f"{r['num_blocks']:,}", f"{r['max_model_len']:,}",
                         len_note]
            else:  # the first reason (weights alone, else the plan's KVPlanError); --json has every one
                cells = ["–", "–", "–", f"**refused**: {r['refused'].split('; KVPlanError')[0]}"]
            lines.append(f"| {m['model']} | {params} | {m['weight_bytes'] / GIB:.2f} | {r['device_gib']} | "
                         + " | ".join(cells) + " |")
    lines += ["", f"Weights as the decoder holds them (quantized projections, and FP8 experts, at their bytes: "
              f"fp8_bytes / int4_bytes; embeddings, lm_head, norms, biases, routers in bf16); the vision tower runs in "
              f"the encoder and is not on the decoder. K/V in bf16, blocks of {BLOCK_SIZE}, from plan_kv_cache at "
              f"--gpu-memory-utilization {UTILIZATION:g} with the weights as the memory used: activations (the "
              "profiling forward's peak, CUDA graphs) are extra, so a real start-up gets fewer blocks. "
              "`python -m epd_builders.quant_plans`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epd_builders.quant_plans", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a Markdown table")
    p.add_argument("--devices-gib", type=int, nargs="+", default=list(DEVICES_GIB), help="device sizes in GiB")
    args = p.parse_args(argv)
    result = plans(tuple(args.devices_gib))
    print(json.dumps(result, indent=1) if args.json else markdown(result))


if __name__ == "__main__":
    main()
