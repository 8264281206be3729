"""Qwen2-VL family: ViT with a patch merger inside `visual`; a Qwen2 LM with M-RoPE positions."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VisionTransformerPretrainedModel,
    Qwen2VLTextModel,
)

from epd_contracts.embeddings import ImageFeatures
from epd_models.base import FamilyAdapter, LanguageModules


class QwenVision(nn.Module):
    """visual.* (the patch merger inside it is the projector), as in the checkpoint."""

    def __init__(self, visual: Any):
        super().__init__()
        self.visual: Any = visual


class Qwen2VLAdapter(FamilyAdapter):
    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    key_renames = (
        (r"^model\.language_model\.", "language_model."),  # transformers >= 4.52 layout
        (r"^model\.visual\.", "visual."),
        (r"^model\.", "language_model."),  # legacy hub layout: model.layers.*, model.embed_tokens.*
    )
    vision_prefixes = ("visual.",)
    vision_cls: Any = Qwen2VisionTransformerPretrainedModel
    text_cls: Any = Qwen2VLTextModel

    def build_vision(self, cfg: PretrainedConfig) -> nn.Module:
        return QwenVision(self.vision_cls._from_config(cfg.vision_config))

    def preprocess(self, image_processor: Any, images: list[Any], detail: str = "auto") -> dict[str, torch.Tensor]:
        kwargs = {}
        if detail == "low":  # the processor's minimum pixels: the fewest image tokens this checkpoint makes
            least = image_processor.size["shortest_edge"]
            kwargs["size"] = {"shortest_edge": least, "longest_edge": least}
        out = image_processor(images=images, return_tensors="pt", **kwargs)
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def encode(self, vision: nn.Module, cfg: PretrainedConfig, inputs: dict[str, torch.Tensor]) -> list[ImageFeatures]:
        assert isinstance(vision, QwenVision), "built by build_vision"
        grid = inputs["image_grid_thw"]  # stays on the host for the sizes below; the tower gets its own copy
        weight = next(vision.parameters())
        pixel_values = inputs["pixel_values"].to(weight.device, weight.dtype, non_blocking=True)
        merged = vision.visual(pixel_values, grid_thw=grid.to(weight.device)).pooler_output
        sizes = (grid.prod(-1) // cfg.vision_config.spatial_merge_size**2).tolist()
        return [
            ImageFeatures(embeds=e, grid_thw=tuple(int(x) for x in g))  # type: ignore[arg-type]
            for e, g in zip(torch.split(merged, sizes), grid, strict=True)
        ]

    def num_image_tokens(self, image_processor: Any, cfg: PretrainedConfig, width: int, height: int) -> int:
        patches = image_processor.get_number_of_image_patches(height, width, {})
        return int(patches) // cfg.vision_config.spatial_merge_size**2

    def build_language(self, cfg: PretrainedConfig) -> LanguageModules:
        tc = cfg.text_config
        return LanguageModules(self.text_cls._from_config(tc), tc.hidden_size, tc.vocab_size)

    def position_ids(
        self, cfg: PretrainedConfig, input_ids: torch.Tensor, images: list[ImageFeatures]
    ) -> tuple[torch.Tensor, int]:
        """M-RoPE: text advances all 3 axes; an image spans (t, h, w) of its merged grid."""
        merge = cfg.vision_config.spatial_merge_size
        ids = input_ids.view(-1).tolist()
        image_id = self.image_token_id(cfg)
        grids = iter(im.grid_thw for im in images)
        chunks: list[torch.Tensor] = []
        pos, i = 0, 0
        while i < len(ids):
            if ids[i] != image_id:
                j = i
                while j < len(ids) and ids[j] != image_id:
                    j += 1
                chunks.append(torch.arange(pos, pos + j - i).view(1, -1).expand(3, -1))
                pos += j - i
            else:
                grid = next(grids)
                assert grid is not None, "Qwen image features need grid_thw"
                t, h, w = grid[0], grid[1] // merge, grid[2] // merge
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                chunks.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
                pos += max(h, w)
                j = i + t * h * w
            i = j
        positions = torch.cat(chunks, dim=1)
        delta = int(positions.max()) + 1 - len(ids)
        return positions.view(3, 1, -1), delta

    def decode_position_ids(self, past_len: int, rope_delta: int) -> torch.Tensor:
        return torch.full((3, 1, 1), past_len + rope_delta, dtype=torch.long)
