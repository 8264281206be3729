"""Qwen's multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): text advances all 3 axes; an image spans (t, h, w)
of its merged patch grid. The same algorithm as the families' `get_rope_index` (checked against it in tests).

A video (Qwen2-VL, Qwen2.5-VL) is a run of video tokens over a grid with t > 1 temporal patches; Qwen2.5-VL
spaces their temporal positions by `tokens_per_second * second_per_grid_t` (truncated, as its
`get_vision_position_ids` does in float32), Qwen2-VL by 1 (its config has no tokens_per_second). Qwen3-VL writes
each temporal patch of a video as its own group between time stamps, positioned like an image of one temporal
patch (epd_models/qwen3_vl.py: `item_runs`).

This module also holds the Qwen families' video encoding (`encode_video`): their video processor's inputs
(epd_models/video.py) through the model's `get_video_features`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from epd_contracts.embeddings import ImageFeatures
from epd_models.base import FamilyAdapter, _rows, _to
from epd_models.video import qwen_video_inputs

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from epd_models.video import VideoClip, VideoInputs, VideoSettings

Run = tuple[torch.Tensor, int, int, bool]  # one run of media tokens: temporal positions, merged h, merged w, video


class MRopeAdapter(FamilyAdapter):
    def position_ids(
        self, cfg: PretrainedConfig, input_ids: torch.Tensor, images: list[ImageFeatures]
    ) -> tuple[torch.Tensor, int]:
        ids = input_ids.view(-1).tolist()
        image_id, video_id = self.image_token_id(cfg), self.video_token_id(cfg)
        media = {image_id} if video_id is None else {image_id, video_id}
        runs = iter([run for item in images for run in self.item_runs(cfg, item)])
        chunks: list[torch.Tensor] = []
        pos, i = 0, 0
        while i < len(ids):
            if ids[i] not in media:
                j = i
                while j < len(ids) and ids[j] not in media:
                    j += 1
                chunks.append(torch.arange(pos, pos + j - i).view(1, -1).expand(3, -1))
                pos += j - i
            else:
                temporal, h, w, is_video = next(runs)
                assert is_video == (ids[i] == video_id), "an image's features at a video's tokens, or back"
                tt, hh, ww = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
                chunks.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
                pos += max(h, w)
                j = i + len(temporal) * h * w
            i = j
        positions = torch.cat(chunks, dim=1)
        delta = int(positions.max()) + 1 - len(ids)
        return positions.view(3, 1, -1), delta

    def item_runs(self, cfg: PretrainedConfig, item: ImageFeatures) -> list[Run]:
        """The runs of media tokens an item takes in the prompt, in order: one (its whole grid) for Qwen2."""
        grid = item.grid_thw
        assert grid is not None, "Qwen image features need grid_thw"
        merge = cfg.vision_config.spatial_merge_size
        return [(_temporal(cfg, item, grid[0]), grid[1] // merge, grid[2] // merge, item.is_video)]

    def decode_position_ids(self, past_len: int, rope_delta: int) -> torch.Tensor:
        return torch.full((3, 1, 1), past_len + rope_delta, dtype=torch.long)

    def encode_video(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, settings: VideoSettings,
                     clip: VideoClip) -> ImageFeatures:
        """Qwen2-VL / Qwen2.5-VL: the rows, grid and seconds per temporal patch."""
        return self.encode_videos(vision, processor, cfg, settings, [clip])[0]

    def encode_videos(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, settings: VideoSettings,
                      clips: list[VideoClip]) -> list[ImageFeatures]:
        """Qwen2-VL / Qwen2.5-VL: every clip's patches in one forward (the tower attends within each clip's grid,
        as it does for a batch of images), split back per clip."""
        videos = [qwen_video_inputs(processor.image_processor, settings, clip) for clip in clips]
        res = video_features(vision, videos)
        return [ImageFeatures(embeds=_rows(rows), grid_thw=video.video_grid_thw,
                              second_per_grid_t=video.second_per_grid_t)
                for rows, video in zip(res.pooler_output, videos, strict=True)]


def video_features(vision: nn.Module, videos: list[VideoInputs]) -> Any:
    """The model's `get_video_features` on videos' inputs joined (its pooler_output is split per video), on the
    vision's device and dtype."""
    weight = next(vision.parameters())
    grid = torch.tensor([video.video_grid_thw for video in videos], device=weight.device)
    pixels = torch.cat([video.pixel_values_videos for video in videos])
    return vision.get_video_features(  # type: ignore[operator]
        pixel_values_videos=_to(pixels, weight), video_grid_thw=grid)


def _temporal(cfg: PretrainedConfig, item: ImageFeatures, t: int) -> torch.Tensor:
    """The temporal positions of an item's t patches: 0..t-1, or for a Qwen2.5-VL video
    floor(k * tokens_per_second * second_per_grid_t) computed as `get_vision_position_ids` does (the processor's
    second_per_grid_ts is a float32 tensor, so the product is float32 before the cast)."""
    per_second = getattr(cfg.vision_config, "tokens_per_second", None)
    if item.second_per_grid_t is None or per_second is None:
        return torch.arange(t)
    interval = per_second * torch.tensor(item.second_per_grid_t, dtype=torch.float32)
    return (torch.arange(t) * interval).long()


def qwen_low_detail(image_processor: object) -> dict[str, object]:
    """The processor's minimum pixels: the fewest image tokens this checkpoint makes (image_url.detail "low")."""
    least = image_processor.size["shortest_edge"]  # type: ignore[attr-defined]
    return {"size": {"shortest_edge": least, "longest_edge": least}}
