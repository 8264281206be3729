"""Tiny Qwen3-VL-MoE checkpoints: tiny Qwen3-VL (epd_builders/families/qwen3_vl.py) whose LM layers are all sparse
mixture-of-experts blocks (decoder_sparse_step 1, as the hub's Qwen3-VL-30B-A3B and 235B-A22B).

Four experts, two per token. `moe_intermediate_size` is neither the hidden size nor half of it, so the experts'
fused tensors (gate_up_proj (E, 2 * I, H), down_proj (E, H, I)) are not square: a checkpoint that stores them
transposed (the hub's layout) is told apart by shape, the rule transformers' own loading follows
(epd_models/base.py: `checkpoint_layouts`).
"""
from __future__ import annotations

from typing import Any

from transformers import Qwen3VLMoeConfig

from epd_builders.families.common import Built
from epd_builders.families.qwen3_vl import build_qwen3

EXPERTS, EXPERTS_PER_TOKEN = 4, 2


def build(spec: Any) -> Built:
    moe = spec.text_hidden * 3 // 4  # 48 for the default 64: 2 * 48 != 64 and 48 != 64
    return build_qwen3(spec, Qwen3VLMoeConfig, num_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
                       moe_intermediate_size=moe, decoder_sparse_step=1)
