"""LLaVA family: CLIP-style vision tower + MLP projector; a Llama-style LM with 1-D positions."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from epd_contracts.embeddings import ImageFeatures
from epd_models.base import FamilyAdapter, LanguageModules


class LlavaVision(nn.Module):
    """vision_tower.* + multi_modal_projector.*, as in the checkpoint."""

    def __init__(self, cfg: Any):
        super().__init__()
        self.vision_tower: Any = AutoModel.from_config(cfg.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(cfg)


class LlavaAdapter(FamilyAdapter):
    name = "llava"
    model_types = ("llava",)
    key_renames = (
        (r"^language_model\.model\.", "language_model."),  # legacy hub layout
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^model\.language_model\.", "language_model."),  # transformers >= 4.52 layout
        (r"^model\.vision_tower\.", "vision_tower."),
        (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
    )
    vision_prefixes = ("vision_tower.", "multi_modal_projector.")

    def build_vision(self, cfg: PretrainedConfig) -> nn.Module:
        return LlavaVision(cfg)

    def preprocess(self, image_processor: Any, images: list[Any], detail: str = "auto") -> dict[str, torch.Tensor]:
        return {"pixel_values": image_processor(images=images, return_tensors="pt")["pixel_values"]}

    def encode(self, vision: nn.Module, cfg: PretrainedConfig, inputs: dict[str, torch.Tensor]) -> list[ImageFeatures]:
        assert isinstance(vision, LlavaVision), "built by build_vision"
        weight = next(vision.parameters())
        pixel_values = inputs["pixel_values"].to(weight.device, weight.dtype, non_blocking=True)
        out = vision.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        layers = cfg.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        hidden = [out.hidden_states[i] for i in layers]
        if cfg.vision_feature_select_strategy == "default":
            hidden = [h[:, 1:] for h in hidden]  # drop CLS
        feats = vision.multi_modal_projector(torch.cat(hidden, dim=-1))
        return [ImageFeatures(embeds=f) for f in feats]

    def num_image_tokens(self, image_processor: Any, cfg: PretrainedConfig, width: int, height: int) -> int:
        vc = cfg.vision_config
        n = (vc.image_size // vc.patch_size) ** 2
        return n if cfg.vision_feature_select_strategy == "default" else n + 1

    def build_language(self, cfg: PretrainedConfig) -> LanguageModules:
        tc = cfg.text_config
        return LanguageModules(AutoModel.from_config(tc), tc.hidden_size, tc.vocab_size)
