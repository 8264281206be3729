"""Qwen3-VL: Qwen's M-RoPE plus DeepStack (features of several vision layers added to the first LM layers'
hidden states at the image positions, in prefill only).

`Qwen3VLTextModel.forward(visual_pos_masks, deepstack_visual_embeds)` does, after decoder layer k < K:
`h[visual_pos_masks] += deepstack_visual_embeds[k]`, the rows in the mask's (row-major) order. So a prefill
chunk [start, end) passes the mask's columns start..end-1 and, of each layer's rows (every image of the
prompt, in prompt order), those of the image positions inside the chunk: a chunk that cuts through an image
gets exactly its part, and a chunk without image positions passes nothing (decode steps never do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from epd_contracts.embeddings import ImageFeatures
from epd_models.mrope import MRopeAdapter

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True, eq=False)
class DeepStackState:
    """One prompt's DeepStack inputs, on the LM's device, and where each position's rows start."""

    is_image: torch.Tensor  # (L,) bool: the prompt's image-token positions
    layers: list[torch.Tensor]  # K x (num image tokens of the prompt, hidden): every image's rows, in order
    rows_before: list[int]  # position -> image tokens before it (L + 1 entries, host ints)


class Qwen3VLAdapter(MRopeAdapter):
    def prefill_state(self, cfg: PretrainedConfig, input_ids: torch.Tensor, images: list[ImageFeatures],
                      device: torch.device) -> DeepStackState | None:
        if not images:
            return None
        assert all(im.deepstack is not None for im in images), "Qwen3-VL image features need DeepStack features"
        is_image = input_ids.view(-1) == self.image_token_id(cfg)
        rows_before = [0, *torch.cumsum(is_image, 0).tolist()]
        deep = torch.cat([im.deepstack for im in images], dim=1)  # type: ignore[misc]  # (K, N, hidden)
        assert deep.shape[1] == rows_before[-1], "DeepStack rows != image tokens in the prompt"
        deep = deep.to(device, non_blocking=True)
        return DeepStackState(is_image.to(device, non_blocking=True), list(deep.unbind(0)), rows_before)

    def prefill_kwargs(self, state: Any, start: int, end: int) -> dict[str, Any]:
        if state is None:
            return {}
        first, last = state.rows_before[start], state.rows_before[end]
        if first == last:  # no image position in this chunk
            return {}
        return {"visual_pos_masks": state.is_image[start:end].view(1, -1),
                "deepstack_visual_embeds": [layer[first:last] for layer in state.layers]}
