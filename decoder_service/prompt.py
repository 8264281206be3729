"""Chat messages -> token ids with each image placeholder replaced by the image's span (its family's tokens)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from epd_contracts.embeddings import ImageFeatures
from epd_models.base import splice_spans
from epd_models.halves import LanguageHalf


@dataclass(frozen=True)
class Prompt:
    input_ids: torch.Tensor  # (1, L) int64, placeholders expanded
    images: list[ImageFeatures]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])


def build_prompt(lm: LanguageHalf, ids: list[int], images: list[ImageFeatures]) -> Prompt:
    spans = [im.span if im.span is not None else [lm.image_token_id] * im.num_tokens for im in images]
    expanded = splice_spans(ids, lm.placeholder_id, spans)
    return Prompt(input_ids=torch.tensor([expanded], dtype=torch.long), images=images)
