"""Qwen3-VL: Qwen's M-RoPE plus DeepStack (features of several vision layers added to the first LM layers'
hidden states at the image and video positions, in prefill only), and its video layout.

`Qwen3VLTextModel.forward(visual_pos_masks, deepstack_visual_embeds)` does, after decoder layer k < K:
`h[visual_pos_masks] += deepstack_visual_embeds[k]`, the rows in the mask's (row-major) order. The mask is the
image AND video tokens (`Qwen3VLModel.forward`: image_mask | video_mask, each kind's rows in their positions), so
the rows are every item's of the prompt, in prompt order. A prefill chunk [start, end) passes the mask's columns
start..end-1 and, of each layer's rows, those of the positions inside the chunk: a chunk that cuts through an item
gets exactly its part, and a chunk without such positions passes nothing (decode steps never do).

A video (epd_models/video_qwen3.py) is written as one group per temporal patch, "<t seconds>" then
<|vision_start|> <|video_pad|>... <|vision_end|>; `get_rope_index` positions each group as an image of one
temporal patch (it splits video_grid_thw (t, h, w) into t grids (1, h, w)), so the temporal axis carries no frame
index: the time stamps do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from epd_contracts.embeddings import ImageFeatures
from epd_models.base import FamilyAdapter, _rows
from epd_models.mrope import MRopeAdapter, Run, video_features
from epd_models.video import qwen_video_inputs
from epd_models.video_qwen3 import video_span

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from epd_models.video import VideoClip, VideoSettings


@dataclass(frozen=True, eq=False)
class DeepStackState:
    """One prompt's DeepStack inputs, on the LM's device, and where each position's rows start."""

    is_image: torch.Tensor  # (L,) bool: the prompt's image- and video-token positions
    layers: list[torch.Tensor]  # K x (num image and video tokens of the prompt, hidden): every item's rows, in order
    rows_before: list[int]  # position -> image and video tokens before it (L + 1 entries, host ints)


class Qwen3VLAdapter(MRopeAdapter):
    def prefill_state(self, cfg: PretrainedConfig, input_ids: torch.Tensor, images: list[ImageFeatures],
                      device: torch.device) -> DeepStackState | None:
        if not images:
            return None
        assert all(im.deepstack is not None for im in images), "Qwen3-VL image features need DeepStack features"
        ids = input_ids.view(-1)
        video_id = self.video_token_id(cfg)
        is_image = ids == self.image_token_id(cfg)
        if video_id is not None:
            is_image = is_image | (ids == video_id)
        rows_before = [0, *torch.cumsum(is_image, 0).tolist()]
        deep = torch.cat([im.deepstack for im in images], dim=1)  # type: ignore[misc]  # (K, N, hidden)
        assert deep.shape[1] == rows_before[-1], "DeepStack rows != image and video tokens in the prompt"
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

    def item_runs(self, cfg: PretrainedConfig, item: ImageFeatures) -> list[Run]:
        """A video: one run per temporal patch, each at temporal offset 0 (`get_rope_index` splits its grid)."""
        if not item.is_video:
            return super().item_runs(cfg, item)
        assert item.grid_thw is not None, "Qwen video features need grid_thw"
        t, h, w = item.grid_thw
        merge = cfg.vision_config.spatial_merge_size
        return [(torch.zeros(1, dtype=torch.long), h // merge, w // merge, True)] * t

    # one forward per clip (the base's loop, not Qwen2's join): Qwen3-VL's vision does not batch exactly
    # (FamilySpec.batches_exactly), and each clip's DeepStack features come from its own forward
    encode_videos = FamilyAdapter.encode_videos

    def encode_video(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, settings: VideoSettings,
                     clip: VideoClip) -> ImageFeatures:
        """The rows, their DeepStack features (K, N, hidden) and the span with the patches' time stamps."""
        times = clip.times()  # before any pixel work: a chunk without them is refused
        video = qwen_video_inputs(processor.image_processor, settings, clip)
        res = video_features(vision, [video])
        rows = _rows(res.pooler_output)
        per_patch = rows.shape[0] // video.video_grid_thw[0]
        span = video_span(processor, times, settings.temporal_patch_size, per_patch)
        return ImageFeatures(embeds=rows, grid_thw=video.video_grid_thw, span=span,
                             deepstack=torch.stack([_rows(d) for d in res.deepstack_features]),
                             second_per_grid_t=video.second_per_grid_t)
