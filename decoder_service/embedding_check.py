"""Checks every embedding a decoder receives against its own language model, before it is cached or used.

An encoder of another model (or a broken or hostile one) can send embeddings of the wrong width or token
count; merged into a prompt they would fail the prefill of that request at best, and fill the decoder's
cache with unusable items at worst. What is checked, per item:
- a floating dtype and 2-D shape (num_tokens, width);
- width == the LM's input embedding width;
- num_tokens == what the family yields: LLaVA a fixed count (the vision tower's patches, CLS dropped or
  not); Qwen2-VL / 2.5-VL t*h*w / merge**2 of its grid_thw (which must be there, positive, and divisible
  by the merge size);
- finite values: a NaN or inf would make its own request's output garbage and is cheap to find (one pass
  over a few MB, next to a prefill over the same tokens).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from epd_contracts.embeddings import ImageFeatures
from epd_models.halves import LanguageHalf


class EmbeddingCheck:
    """`check(out) -> reason | None` for ECConsumer(check=...) and the aggregated InlineEncoder."""

    def __init__(self, lm: LanguageHalf):
        cfg: Any = lm.config
        self.width = int(lm.module.language_model.embed_tokens.embedding_dim)
        self.merge: int | None = getattr(getattr(cfg, "vision_config", None), "spatial_merge_size", None)
        self.fixed = _fixed_count(lm) if self.merge is None else None

    def __call__(self, out: ImageFeatures) -> str | None:
        e = out.embeds
        if not (e.is_floating_point() and e.dim() == 2):
            return f"expected a 2-D floating tensor, got {e.dtype} of shape {tuple(e.shape)}"
        if e.shape[1] != self.width:
            return f"width {e.shape[1]} != this model's embedding width {self.width} (an encoder of another model?)"
        expected = self._expected_tokens(out)
        if isinstance(expected, str):
            return expected
        if expected is not None and e.shape[0] != expected:
            return f"{e.shape[0]} image tokens, but this model expects {expected}"
        if not bool(torch.isfinite(e).all()):
            return "non-finite values (NaN or inf)"
        return None

    def _expected_tokens(self, out: ImageFeatures) -> int | str | None:
        """The token count this model expects for the item, a reason its grid is unusable, or None (unknown)."""
        if self.merge is None:
            return self.fixed
        grid = out.grid_thw
        if grid is None:
            return "grid_thw is missing (this model needs it for positions)"
        if not all(isinstance(x, int) and x > 0 for x in grid) or grid[1] % self.merge or grid[2] % self.merge:
            return f"grid_thw {tuple(grid)} is not positive or not divisible by the merge size {self.merge}"
        return math.prod(grid) // self.merge**2


def _fixed_count(lm: LanguageHalf) -> int | None:
    """Image tokens per image for families with a fixed count (LLaVA); None where the family is unknown."""
    if lm.adapter.name != "llava":
        return None
    return int(lm.adapter.num_image_tokens(None, lm.config, 0, 0))  # depends on the vision config only
