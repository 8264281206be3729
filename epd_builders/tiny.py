"""Builders for tiny random VLMs of each family, saved in Hugging Face format with tokenizer and processor."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForImageTextToText,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaProcessor,
    Qwen2_5_VLConfig,
    Qwen2VLConfig,
)
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLVisionConfig
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig, Qwen2VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import logging as hf_logging

from epd_builders.tokenizer import train_tokenizer
from epd_models.processors import Qwen2_5_VLImageProcessorOnly, Qwen2VLImageProcessorOnly

hf_logging.disable_progress_bar()
FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl")
QWEN_IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class TinySpec:
    family: str = "llava"
    text_hidden: int = 64
    text_layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vision_hidden: int = 64
    vision_layers: int = 2
    image_size: int = 224  # LLaVA: square input; Qwen: longest edge of the pixel budget
    patch: int = 14
    lm_scale: float = 1.0  # >1 makes a random LM's greedy output less degenerate
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.family in FAMILIES, f"unknown family {self.family!r}; one of {FAMILIES}"


def build_tiny(spec: TinySpec, out_dir: str | Path) -> Path:
    """Build a random model for spec, save model + tokenizer + processor to out_dir, return it."""
    out = Path(out_dir)
    torch.manual_seed(spec.seed)
    if spec.family == "llava":
        tok = train_tokenizer("<image>", "<image>")
        cfg, proc = _llava(spec, tok)
    else:
        tok = train_tokenizer("<|image_pad|>", QWEN_IMAGE_MARKUP)
        cfg, proc = _qwen(spec, tok)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    if spec.lm_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "language_model" in name and p.dim() > 1:
                    p.mul_(spec.lm_scale)
    _set_generation_ids(model, tok)
    model.save_pretrained(out)
    proc.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _set_generation_ids(model: Any, tok: Any) -> None:
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id


def _special_ids(tok: Any) -> dict[str, Any]:
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def llava_config(tok: Any, vision: dict[str, Any], text: dict[str, Any]) -> LlavaConfig:
    """A LLaVA (CLIP tower + Llama LM) config; `vision` are CLIPVisionConfig sizes, `text` LlamaConfig sizes."""
    return LlavaConfig(
        vision_config=CLIPVisionConfig(**vision, projection_dim=vision["hidden_size"]),
        text_config=LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, **text, **_special_ids(tok)),
        image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
    )


def llava_processor(tok: Any, image_size: int, patch: int) -> LlavaProcessor:
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=patch,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, chat_template=tok.chat_template,
    )


def _llava(spec: TinySpec, tok: Any) -> tuple[Any, Any]:
    vision: dict[str, Any] = dict(hidden_size=spec.vision_hidden, intermediate_size=spec.vision_hidden * 2,
                  num_hidden_layers=spec.vision_layers, num_attention_heads=spec.heads,
                  image_size=spec.image_size, patch_size=spec.patch)
    text: dict[str, Any] = dict(hidden_size=spec.text_hidden, intermediate_size=spec.text_hidden * 2,
                num_hidden_layers=spec.text_layers, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, max_position_embeddings=4096)
    return llava_config(tok, vision, text), llava_processor(tok, spec.image_size, spec.patch)


def _qwen(spec: TinySpec, tok: Any) -> tuple[Any, Any]:
    head_dim = spec.text_hidden // spec.heads
    third = head_dim // 2 // 3
    text_kwargs: dict[str, Any] = dict(
        vocab_size=len(tok), hidden_size=spec.text_hidden, intermediate_size=spec.text_hidden * 2,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=False, **_special_ids(tok),
        rope_parameters={
            "rope_type": "default", "rope_theta": 1e4,
            "mrope_section": [head_dim // 2 - 2 * third, third, third],  # sum == head_dim // 2
        },
    )
    ids = {
        "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>"),
    }
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
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": unit * unit, "longest_edge": spec.image_size * spec.image_size},
        patch_size=spec.patch, temporal_patch_size=2, merge_size=2,
    )
    return cfg, proc_cls(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
