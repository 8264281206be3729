"""Every family EPD serves, and the adapter for a checkpoint's config.

Each family is a `FamilySpec` (what its checkpoints and processor look like) on the generic adapter; a family
with its own LM-side rule has a small adapter subclass (M-RoPE, DeepStack, Gemma 3's image attention).
"""
from __future__ import annotations

from transformers import PretrainedConfig

from epd_models.base import FamilyAdapter, FamilySpec
from epd_models.mrope import MRopeAdapter, qwen_low_detail

CLIP_STYLE = ("vision_tower", "multi_modal_projector")


def _llava_tokens(cfg: object) -> int:
    """LLaVA-1.5: one token per patch (and the CLS token unless the strategy drops it)."""
    vc = cfg.vision_config  # type: ignore[attr-defined]
    n = (vc.image_size // vc.patch_size) ** 2
    return n if cfg.vision_feature_select_strategy == "default" else n + 1  # type: ignore[attr-defined]


def _qwen(name: str) -> FamilySpec:
    return FamilySpec(name=name, model_types=(name,), vision_children=("visual",),
                      feature_inputs=("pixel_values", "image_grid_thw"), low_detail=qwen_low_detail)


ADAPTERS: tuple[FamilyAdapter, ...] = (
    FamilyAdapter(FamilySpec(name="llava", model_types=("llava",), vision_children=CLIP_STYLE,
                             feature_inputs=("pixel_values",), fixed_tokens=_llava_tokens)),
    MRopeAdapter(_qwen("qwen2_vl")),
    MRopeAdapter(_qwen("qwen2_5_vl")),
)


def adapter_for(cfg: PretrainedConfig) -> FamilyAdapter:
    for adapter in ADAPTERS:
        if cfg.model_type in adapter.model_types:
            return adapter
    supported = sorted(t for a in ADAPTERS for t in a.model_types)
    raise ValueError(f"unsupported model_type {cfg.model_type!r}; supported: {supported}")
