"""Gemma 3: image tokens attend to each other both ways within one image (prefill); sliding-window layers.

As transformers builds them (modeling_gemma3.create_masks_for_vision_model): a run of image soft tokens is a
block; full-attention layers see causal OR same block, sliding layers (causal OR same block) AND
kv > q - sliding_window (one-sided: a block's later tokens are seen whatever their distance). Decode steps are
never inside a block: plain causal, and the window on the sliding layers.

The slot engine keeps every layer's whole K/V (no ring buffer for the sliding layers): the window lives in the
mask only, exactly as it does in transformers' prefill.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from epd_models.base import FamilyAdapter

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PretrainedConfig

    from epd_contracts.embeddings import ImageFeatures


@dataclass(frozen=True)
class ImageBlocks:
    """A prompt's image blocks: block id per position on the LM's device, and their [start, end) on the host."""

    ids: torch.Tensor  # (L,) int64: which image each position belongs to, -1 for text
    spans: tuple[tuple[int, int], ...]


class Gemma3Adapter(FamilyAdapter):
    """Block ids per prompt, chunk ends outside blocks, and the two masks by layer type."""

    def encode(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, images: list[Image.Image],
               detail: str = "auto", multi_image: bool = False) -> list[ImageFeatures]:
        """Gemma3Processor reads a flat list as ONE prompt's images: nested, each image is its own prompt (still
        one processor call and one vision forward for them all)."""
        nested: Any = [[im] for im in images]
        return super().encode(vision, processor, cfg, nested, detail, multi_image)

    def prefill_state(self, cfg: PretrainedConfig, input_ids: torch.Tensor, images: list[ImageFeatures],
                      device: torch.device) -> ImageBlocks | None:
        ids = block_ids(input_ids[0] == self.image_token_id(cfg))
        spans = _runs(ids)
        return ImageBlocks(ids.to(device, non_blocking=True), spans) if spans else None

    def chunk_end(self, state: ImageBlocks | None, start: int, end: int) -> int:
        """Never inside a block: end at its start when the chunk began before it, else at its end."""
        for a, b in state.spans if state is not None else ():
            if a < end < b:
                return a if start < a else b
        return end

    def attention_mask(self, cfg: PretrainedConfig, mask: torch.Tensor, starts: list[int],
                       states: list[Any]) -> dict[str, torch.Tensor]:
        tc = cfg.get_text_config()
        assert not tc.use_bidirectional_attention, "bidirectional Gemma 3 (EmbeddingGemma) is not a VLM"
        return layer_masks(mask, states, tc.sliding_window)


def block_ids(is_image: torch.Tensor) -> torch.Tensor:
    """(L,) bool -> (L,) int64: each run of image tokens numbered 0, 1, ...; -1 elsewhere (get_block_sequence_ids)."""
    previous = torch.cat([is_image.new_zeros(1), is_image[:-1]])
    group = torch.cumsum((is_image & ~previous).long(), 0) - 1
    return torch.where(is_image, group, -1)


def _runs(ids: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """[start, end) of each block, in order."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    return tuple((e - c, e) for v, c, e in zip(values.tolist(), counts.tolist(), ends, strict=True) if v >= 0)


def layer_masks(mask: torch.Tensor, states: list[ImageBlocks | None], sliding_window: int) -> dict[str, torch.Tensor]:
    """The slot cache's causal mask (rows, 1, new, kv), row i's query j at position starts[i] + j, as Gemma 3's
    {"full_attention", "sliding_attention"} masks."""
    kv = torch.arange(mask.shape[-1], device=mask.device)
    query = mask.sum(-1, keepdim=True) - 1  # (rows, 1, new, 1): the slot mask is kv <= query position
    full = mask
    if mask.shape[2] > 1 and any(s is not None for s in states):  # a decode step is never inside a block
        full = mask | _same_block(mask, query, states)
    return {"full_attention": full, "sliding_attention": full & (kv > query - sliding_window)}


def _same_block(mask: torch.Tensor, query: torch.Tensor, states: list[ImageBlocks | None]) -> torch.Tensor:
    """(rows, 1, new, kv): query and key are in the same image block of their row's prompt."""
    kv_len = mask.shape[-1]
    rows = [_padded(s, kv_len, mask.device) for s in states]
    blocks = torch.stack(rows).view(len(rows), 1, 1, kv_len)  # key's block
    of_query = torch.gather(blocks.expand(-1, -1, mask.shape[2], -1), 3, query)  # (rows, 1, new, 1)
    return (blocks == of_query) & (of_query >= 0)


def _padded(state: ImageBlocks | None, kv_len: int, device: torch.device) -> torch.Tensor:
    """A row's block ids over kv_len columns: -1 past its prompt (generated tokens) or for a text-only prompt."""
    out = torch.full((kv_len,), -1, dtype=torch.long, device=device)
    if state is not None:
        n = min(kv_len, state.ids.shape[0])
        out[:n] = state.ids[:n]
    return out
