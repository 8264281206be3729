"""Chat messages -> token ids with each image placeholder expanded to its embedding's length."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from epd_contracts.embeddings import ImageFeatures
from epd_models.base import expand_placeholders
from epd_models.halves import LanguageHalf


@dataclass(frozen=True)
class Prompt:
    input_ids: torch.Tensor  # (1, L) int64, placeholders expanded
    images: list[ImageFeatures]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])


def build_prompt(lm: LanguageHalf, ids: list[int], images: list[ImageFeatures]) -> Prompt:
    expanded = expand_placeholders(ids, lm.image_token_id, [im.num_tokens for im in images])
    return Prompt(input_ids=torch.tensor([expanded], dtype=torch.long), images=images)
