"""LLaVA-OneVision: LLaVA-NeXT's any-resolution tiles (anyres_max_9), except that an image in a prompt with several
images is its base tile only (the processor writes fewer tokens, and the model skips the other tiles).

The encoder cannot see the prompt, so it is told (`multi_image`, part of the image's mm_hash) and encodes the image
as the first of a two-image prompt, which is exactly what the family does for every image of such a prompt."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from epd_contracts.embeddings import ImageFeatures
from epd_models.base import FamilyAdapter, _to

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PretrainedConfig


class OnevisionAdapter(FamilyAdapter):
    def encode(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, images: list[Image.Image],
               detail: str = "auto", multi_image: bool = False) -> list[ImageFeatures]:
        if not multi_image:
            return super().encode(vision, processor, cfg, images, detail)
        return [self._encode_in_multi(vision, processor, im) for im in images]

    def _encode_in_multi(self, vision: nn.Module, processor: Any, image: Image.Image) -> ImageFeatures:
        out = processor(text=[processor.image_token * 2], images=[[image, image]], add_special_tokens=False,
                        return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        span = ids[: len(ids) // 2]  # the two copies' spans are equal
        weight = next(vision.parameters())
        feats = vision.get_image_features(  # type: ignore[operator]
            pixel_values=_to(out["pixel_values"][:1], weight), image_sizes=_to(out["image_sizes"][:1], weight),
            batch_num_images=torch.tensor([2])).pooler_output
        rows = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
        return ImageFeatures(embeds=rows, span=None if span == [span[0]] * len(span) else tuple(span))
