"""Qwen's multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): text advances all 3 axes; an image spans (t, h, w)
of its merged patch grid. The same algorithm as the families' `get_rope_index` (checked against it in tests)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epd_contracts.embeddings import ImageFeatures
from epd_models.base import FamilyAdapter

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MRopeAdapter(FamilyAdapter):
    def position_ids(
        self, cfg: PretrainedConfig, input_ids: torch.Tensor, images: list[ImageFeatures]
    ) -> tuple[torch.Tensor, int]:
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


def qwen_low_detail(image_processor: object) -> dict[str, object]:
    """The processor's minimum pixels: the fewest image tokens this checkpoint makes (image_url.detail "low")."""
    least = image_processor.size["shortest_edge"]  # type: ignore[attr-defined]
    return {"size": {"shortest_edge": least, "longest_edge": least}}
