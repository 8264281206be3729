"""One image's embeddings: what a vision half returns, the connector carries and the LM merges.

Torch-free at import (the tensor type is named for the type checker only), so the contracts package stays
importable by the proxy. The key an item is stored under (its mm_hash) travels beside it, never inside it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class ImageFeatures:
    """One image's embeddings as the LM consumes them."""

    embeds: torch.Tensor  # (num_tokens, text_hidden), any device until a producer saves it (then CPU)
    grid_thw: tuple[int, int, int] | None = None  # Qwen only: patch grid before merging

    def __post_init__(self) -> None:
        if getattr(self.embeds, "dim", None) is None or self.embeds.dim() < 1:
            raise ValueError(f"embeds must be a tensor with at least 1 dim, got {type(self.embeds).__name__}")
        if self.grid_thw is not None and len(self.grid_thw) != 3:
            raise ValueError(f"grid_thw must have 3 ints, got {self.grid_thw!r}")

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.embeds.nbytes)
