"""Tiny Qwen2-VL and Qwen2.5-VL checkpoints: a ViT with a patch merger, a Qwen2 LM with M-RoPE."""
from __future__ import annotations

from typing import Any

from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLVisionConfig
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig, Qwen2VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from epd_builders.families.common import Built, text_sizes
from epd_builders.tokenizer import train_tokenizer
from epd_models.processors import Qwen2_5_VLImageProcessorOnly, Qwen2VLImageProcessorOnly

QWEN_IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"


def build(spec: Any) -> Built:
    tok = train_tokenizer("<|image_pad|>", QWEN_IMAGE_MARKUP)
    head_dim = spec.text_hidden // spec.heads
    third = head_dim // 2 // 3
    text_kwargs: dict[str, Any] = dict(
        **text_sizes(spec, tok),
        rope_parameters={
            "rope_type": "default", "rope_theta": 1e4,
            "mrope_section": [head_dim // 2 - 2 * third, third, third],  # sum == head_dim // 2
        },
    )
    ids = qwen_token_ids(tok)
    if spec.family == "qwen2_vl":
        vision: Any = Qwen2VLVisionConfig(
            depth=spec.vision_layers, embed_dim=spec.vision_hidden, hidden_size=spec.text_hidden,
            num_heads=spec.heads, patch_size=spec.patch, spatial_merge_size=2, temporal_patch_size=2,
        )
        cfg: Any = Qwen2VLConfig(text_config=Qwen2VLTextConfig(**text_kwargs), vision_config=vision, **ids)
        proc_cls: Any = Qwen2VLImageProcessorOnly
    else:
        vision = Qwen2_5_VLVisionConfig(
            depth=spec.vision_layers, hidden_size=spec.vision_hidden, out_hidden_size=spec.text_hidden,
            intermediate_size=spec.vision_hidden * 2, num_heads=spec.heads, patch_size=spec.patch,
            spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[spec.vision_layers - 1],
        )
        cfg = Qwen2_5_VLConfig(text_config=Qwen2_5_VLTextConfig(**text_kwargs), vision_config=vision, **ids)
        proc_cls = Qwen2_5_VLImageProcessorOnly
    cfg.tie_word_embeddings = False
    unit = spec.patch * 2  # one merged token covers (patch * merge)^2 pixels
    return Built(cfg, qwen_processor(proc_cls, tok, spec.patch, unit * unit, spec.image_size * spec.image_size), tok)


def qwen_token_ids(tok: Any) -> dict[str, Any]:
    """The config's image, video and vision start/end token ids, from the tokenizer."""
    return {"image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
            "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
            "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
            "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>")}


def qwen_processor(cls: Any, tok: Any, patch: int, min_pixels: int, max_pixels: int) -> Any:
    """An image-only Qwen processor (cls) with 2x2 merging, 2-frame temporal patches and these pixel bounds."""
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                               patch_size=patch, temporal_patch_size=2, merge_size=2)
    return cls(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
