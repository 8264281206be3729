"""Boundary types of the encoder-cache connector."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EncoderOutput:
    """Image embeddings that one encoder computed for one multimodal item."""

    mm_hash: str
    embeds: torch.Tensor  # (num_tokens, hidden), any device until saved by a producer
    grid_thw: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mm_hash, str):
            raise TypeError(f"mm_hash must be str, got {type(self.mm_hash).__name__}")
        if not isinstance(self.embeds, torch.Tensor) or self.embeds.dim() < 1:
            raise ValueError(f"embeds for {self.mm_hash!r} must be a tensor with at least 1 dim")
        if self.grid_thw is not None and len(self.grid_thw) != 3:
            raise ValueError(f"grid_thw for {self.mm_hash!r} must have 3 ints, got {self.grid_thw!r}")

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def nbytes(self) -> int:
        return self.embeds.nbytes  # one call into torch instead of two

    @functools.cached_property
    def wire_spec(self) -> dict[str, Any]:
        """The item fields of a get_reply (num_tokens, grid_thw, dtype, shape), made once per item."""
        from connector.wire import tensor_spec  # NOTE: wire imports torch helpers only; avoid a cycle at import

        spec = tensor_spec(self.embeds, frame=0)
        del spec["frame"]
        grid = list(self.grid_thw) if self.grid_thw is not None else None
        return {"num_tokens": self.num_tokens, "grid_thw": grid, **spec}

    @functools.cached_property
    def wire_buffer(self) -> memoryview:
        """A flat byte view of the embeddings (no copy for a contiguous CPU tensor), made once per item."""
        flat = self.embeds.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return memoryview(flat.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol


class MissingEmbeddings(Exception):
    """Raised when some embeddings are neither cached locally nor found at their producer."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = list(missing)
        # NOTE: args holds the list (not the message) so the exception survives a process boundary.
        super().__init__(self.missing)

    def __str__(self) -> str:
        return f"missing embeddings for {len(self.missing)} item(s): {', '.join(self.missing)}"


class InvalidEmbeddings(Exception):
    """Raised when received embeddings fail the consumer's check against its own model (dtype, width, token count);
    they were not cached."""

    def __init__(self, reasons: dict[str, str]) -> None:
        self.reasons = dict(reasons)  # mm_hash -> why it was refused
        super().__init__(self.reasons)

    def __str__(self) -> str:
        return "embeddings refused: " + "; ".join(f"{h}: {why}" for h, why in self.reasons.items())
