"""LLaVA-OneVision's video inputs: each sampled frame resized to the vision tower's input, without torchvision.

`LlavaOnevisionVideoProcessor` (transformers/models/llava_onevision/video_processing_llava_onevision.py) is the
default `BaseVideoProcessor._preprocess`: every frame resized to size (height, width) (no aspect kept, bicubic),
rescaled and normalized; `pixel_values_videos` is (frames, C, height, width). Here each frame takes the image
processor's own PIL resize, rescale and normalize (the steps its base tile takes, so a frame's pixels equal the
base tile of the same picture), where the stock class resizes tensors with torchvision.

The model (`get_video_features`) runs SigLIP on each frame apart, projects, pools each frame's patch grid 2x2
bilinearly, and appends `image_newline` once after the last frame: frames are independent, so a chunk of frames
is exactly its part of the whole video's rows, and only the video's last chunk carries the newline row.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.image_processing_utils import SizeDict

from epd_models.video import VideoClip, VideoSettings, check_bytes

_WORKING_COPIES = 2  # the normalized frames and their stacked copy


def frame_pixels(image_processor: Any, settings: VideoSettings, clip: VideoClip) -> torch.Tensor:
    """(frames, C, height, width) float32 pixel values of the clip's frames (VideoError over clip.max_bytes)."""
    assert settings.frame_size is not None, "LLaVA-OneVision video settings have a frame size"
    height, width = settings.frame_size
    check_bytes(_WORKING_COPIES * len(clip.frames) * 3 * height * width * 4, len(clip.frames), width, height,
                clip.max_bytes)
    given = dict(settings.overrides)
    ip = image_processor
    resample = given.get("resample", ip.resample)
    scale = given.get("rescale_factor", ip.rescale_factor)
    mean, std = given.get("image_mean", ip.image_mean), given.get("image_std", ip.image_std)
    size = SizeDict(height=height, width=width)
    out = []
    for frame in clip.frames:
        pixels = np.asarray(frame.convert("RGB")).transpose(2, 0, 1)  # (C, H, W) uint8, as the image path reads it
        pixels = ip.normalize(ip.rescale(ip.resize(pixels, size, resample=resample), scale), mean, std)
        out.append(np.asarray(pixels, dtype=np.float32))
    return torch.from_numpy(np.stack(out))
