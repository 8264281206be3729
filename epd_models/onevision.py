"""LLaVA-OneVision: LLaVA-NeXT's any-resolution tiles (anyres_max_9), except that an image in a prompt with several
images is its base tile only (the processor writes fewer tokens, and the model skips the other tiles).

The encoder cannot see the prompt, so it is told (`multi_image`, part of the image's mm_hash) and encodes the image
as the first of a two-image prompt, which is exactly what the family does for every image of such a prompt.

A video (epd_models/video_onevision.py) is its frames through SigLIP one by one, 2x2 bilinear pooling and one
`image_newline` row after the last frame (`get_video_features`); its prompt layout is one video token per row
(`LlavaOnevisionProcessor.replace_video_token`), in place of the one the chat template writes. A chunk that does
not end the video leaves the newline row to the last one."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from epd_contracts.embeddings import ImageFeatures
from epd_models.base import FamilyAdapter, _to
from epd_models.video_onevision import frame_pixels

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PretrainedConfig

    from epd_models.video import VideoClip, VideoSettings


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

    def encode_video(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, settings: VideoSettings,
                     clip: VideoClip) -> ImageFeatures:
        """The frames' pooled rows, and the newline row when the clip ends the video. No grid (1-D positions);
        second_per_grid_t is a frame's seconds (one frame a temporal step) and marks the item as a video."""
        return self.encode_videos(vision, processor, cfg, settings, [clip])[0]

    def encode_videos(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, settings: VideoSettings,
                      clips: list[VideoClip]) -> list[ImageFeatures]:
        """Clips of as many frames as the first go through the tower as one batch (the model's own video batch
        dimension); the others one by one."""
        side = cfg.vision_config.image_size
        if settings.frame_size != (side, side):
            raise ValueError(f"the video processor's frame size {settings.frame_size} is not the vision tower's "
                             f"input ({side}, {side})")
        pixels = [frame_pixels(processor.image_processor, settings, clip) for clip in clips]
        weight = next(vision.parameters())
        rows: list[torch.Tensor] = []
        for same in _runs_of_equal_shape(pixels):
            rows.extend(vision.get_video_features(  # type: ignore[operator]
                pixel_values_videos=_to(torch.stack(same), weight)).pooler_output)
        return [ImageFeatures(embeds=r if clip.last else r[:-1], second_per_grid_t=1 / clip.fps)
                for r, clip in zip(rows, clips, strict=True)]


def _runs_of_equal_shape(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one shape together, in order (what torch.stack can join)."""
    runs: list[list[torch.Tensor]] = []
    for t in tensors:
        if runs and runs[-1][0].shape == t.shape:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs
