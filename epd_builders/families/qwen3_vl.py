"""Tiny Qwen3-VL checkpoints: a ViT whose layers 0 and 1 feed DeepStack mergers, a Qwen3 LM with interleaved M-RoPE.

Three LM layers, so the two DeepStack feature sets are added after layers 0 and 1 and the last layer gets none.
`build_qwen3` is shared with Qwen3-VL-MoE (epd_builders/families/qwen3_vl_moe.py), whose checkpoints differ only
in the LM's MLPs: the config class and a few text-config fields are its arguments.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PretrainedConfig, Qwen3VLConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from epd_builders.families.common import Built, special_ids
from epd_builders.families.qwen import QWEN_IMAGE_MARKUP
from epd_builders.tokenizer import train_tokenizer
from epd_models.processors import Qwen3VLImageProcessorOnly

PATCH, MERGE, HEAD_DIM = 16, 2, 16
UNIT = PATCH * MERGE  # one image token covers UNIT x UNIT pixels
MAX_SIDE = 3 * UNIT  # a 224x224 image -> 96x96 pixels -> 9 tokens; 168x112 -> 96x64 -> 6


def build(spec: Any) -> Built:
    return build_qwen3(spec, Qwen3VLConfig)


def build_qwen3(spec: Any, config_class: Callable[..., PretrainedConfig], **text_extra: Any) -> Built:
    """A Qwen3-VL-style checkpoint of `config_class` (Qwen3VLConfig or Qwen3VLMoeConfig); `text_extra`: the text
    config's fields besides the dense LM's (the MoE's experts)."""
    tok = train_tokenizer("<|image_pad|>", QWEN_IMAGE_MARKUP)
    vision = dict(
        depth=3, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_hidden * 2, num_heads=spec.heads,
        patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=spec.text_hidden,
        num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
    )
    text = dict(
        vocab_size=len(tok), hidden_size=spec.text_hidden, intermediate_size=spec.text_hidden * 2,
        num_hidden_layers=3, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=HEAD_DIM,
        max_position_embeddings=4096, **special_ids(tok),
        # interleaved (t, h, w) frequencies: Qwen3-VL's layout; the section sums to head_dim // 2
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True},
        **text_extra,
    )
    ids: dict[str, Any] = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    cfg = config_class(vision_config=vision, text_config=text, tie_word_embeddings=False, **ids)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": UNIT * UNIT, "longest_edge": MAX_SIDE * MAX_SIDE}, patch_size=PATCH,
        temporal_patch_size=2, merge_size=MERGE, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )
    processor = Qwen3VLImageProcessorOnly(image_processor=image_processor, tokenizer=tok,
                                          chat_template=tok.chat_template)
    return Built(cfg, processor, tok)
