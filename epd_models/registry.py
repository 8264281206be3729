"""Every family EPD serves, and the adapter for a checkpoint's config.

Each family is a `FamilySpec` (what its checkpoints and processor look like) on the generic adapter; a family
with its own LM-side rule has a small adapter subclass (M-RoPE, DeepStack, Gemma 3's image attention).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from epd_models.base import FamilyAdapter, FamilySpec
from epd_models.gemma3 import Gemma3Adapter
from epd_models.mrope import MRopeAdapter, qwen_low_detail
from epd_models.onevision import OnevisionAdapter
from epd_models.phi4_multimodal import Phi4MultimodalAdapter
from epd_models.qwen2_5_omni import Qwen2_5OmniAdapter
from epd_models.qwen2_audio import Qwen2AudioAdapter
from epd_models.qwen3_vl import Qwen3VLAdapter

CLIP_STYLE = ("vision_tower", "multi_modal_projector")  # LLaVA's names, kept by most families since


def _llava_tokens(cfg: Any) -> int:
    """LLaVA-1.5: one token per patch (and the CLS token unless the strategy drops it)."""
    vc = cfg.vision_config
    n = (vc.image_size // vc.patch_size) ** 2
    return int(n if cfg.vision_feature_select_strategy == "default" else n + 1)


def _qwen(name: str, batches_exactly: bool = True) -> FamilySpec:
    return FamilySpec(name=name, model_types=(name,), vision_children=("visual",),
                      feature_inputs=("pixel_values", "image_grid_thw"), low_detail=qwen_low_detail,
                      batches_exactly=batches_exactly)


ADAPTERS: tuple[FamilyAdapter, ...] = (
    FamilyAdapter(FamilySpec(name="llava", model_types=("llava",), vision_children=CLIP_STYLE,
                             feature_inputs=("pixel_values",), fixed_tokens=_llava_tokens)),
    MRopeAdapter(_qwen("qwen2_vl")),
    MRopeAdapter(_qwen("qwen2_5_vl")),
    Qwen3VLAdapter(_qwen("qwen3_vl", batches_exactly=False)),
    # Qwen3-VL with mixture-of-experts LM layers: the same adapter (the module runs its experts itself)
    Qwen3VLAdapter(_qwen("qwen3_vl_moe", batches_exactly=False)),
    # any-resolution tiles; unpadding and the row newlines happen inside get_image_features (image_newline)
    FamilyAdapter(FamilySpec(name="llava_next", model_types=("llava_next",),
                             vision_children=(*CLIP_STYLE, "image_newline"),
                             feature_inputs=("pixel_values", "image_sizes"))),
    OnevisionAdapter(FamilySpec(name="llava_onevision", model_types=("llava_onevision",),
                                vision_children=(*CLIP_STYLE, "image_newline"),
                                feature_inputs=("pixel_values", "image_sizes"), multi_image_variant=True)),
    Gemma3Adapter(FamilySpec(name="gemma3", model_types=("gemma3",), vision_children=CLIP_STYLE,
                             feature_inputs=("pixel_values",), placeholder_attr="boi_token_index",
                             layout_tokens=r"<start_of_image>|<end_of_image>", text_edges=("\n\n", "\n\n"),
                             fixed_tokens=lambda cfg: int(cfg.mm_tokens_per_image))),
    # tiles and pixel shuffle inside get_image_features; its output is not split per image: one image per call
    FamilyAdapter(FamilySpec(name="internvl", model_types=("internvl",), vision_children=CLIP_STYLE,
                             feature_inputs=("pixel_values",), layout_tokens=r"<img>|</img>", batch_encode=False)),
    FamilyAdapter(FamilySpec(name="mistral3", model_types=("mistral3",), vision_children=CLIP_STYLE,
                             feature_inputs=("pixel_values", "image_sizes"),
                             layout_tokens=r"\[IMG_BREAK\]|\[IMG_END\]")),
    FamilyAdapter(FamilySpec(name="idefics3", model_types=("idefics3",), vision_children=("vision_model", "connector"),
                             text_child="text_model", feature_inputs=("pixel_values", "pixel_attention_mask"),
                             layout_tokens=r"<fake_token_around_image>|<global-img>|<row_\d+_col_\d+>",
                             layout_text=("\n",), batch_encode=False)),
    # audio in, text out (epd_models/audio.py): the encoder half is the audio tower and projector
    Qwen2AudioAdapter(FamilySpec(name="qwen2_audio", model_types=("qwen2_audio",),
                                 vision_children=("audio_tower", "multi_modal_projector"),
                                 feature_inputs=("input_features", "feature_attention_mask"))),
    # audio in, text out; the LM is the base model itself and the towers sit in its embed_tokens_extend (audio only)
    Phi4MultimodalAdapter(FamilySpec(name="phi4_multimodal", model_types=("phi4_multimodal",),
                                     vision_children=("embed_tokens_extend",), feature_inputs=("audio_input_features",),
                                     shipped_loras=(("image", "vision-lora"), ("audio", "speech-lora")))),
    # Qwen2.5-Omni's thinker: audio, images and videos in, text out; the encoder half is both towers
    Qwen2_5OmniAdapter(FamilySpec(name="qwen2_5_omni", model_types=("qwen2_5_omni_thinker",),
                                  vision_children=("audio_tower", "visual"),
                                  feature_inputs=("pixel_values", "image_grid_thw"), low_detail=qwen_low_detail,
                                  skip_prefixes=("talker.", "token2wav."))),
)


# composite checkpoints whose served model is one of their parts: model_type -> the attribute of its config
# (Qwen2.5-Omni's hub checkpoints hold the thinker, which EPD serves, with the talker and token2wav beside it)
COMPOSITES = {"qwen2_5_omni": "thinker_config"}


def load_config(model_dir: str | Path) -> PretrainedConfig:
    """The config of the model a checkpoint serves: its config.json's, or the served part's of a composite."""
    cfg = AutoConfig.from_pretrained(model_dir)
    part = COMPOSITES.get(cfg.model_type)
    return getattr(cfg, part) if part is not None else cfg


def adapter_for(cfg: PretrainedConfig) -> FamilyAdapter:
    for adapter in ADAPTERS:
        if cfg.model_type in adapter.model_types:
            return adapter
    supported = sorted(t for a in ADAPTERS for t in a.model_types)
    raise ValueError(f"unsupported model_type {cfg.model_type!r}; supported: {supported}")
