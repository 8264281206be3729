"""How many embedding rows (prompt tokens) a sampled video makes, without torch: the proxy's count before any /encode.

The rules, each restating the transformers 5.24 code it mirrors (tests/encoder_service/test_video_tokens.py checks
them against that code and against what the tiny models' encoders return):

- Qwen2-VL / Qwen2.5-VL ("qwen2" sampler): every frame resized by `smart_resize` (image_processing_pil_qwen2_vl.py)
  to a multiple of patch_size * merge_size within [min_pixels, the request's max_pixels] per frame; rows:
  ceil(frames / temporal_patch) * (h / (p * m)) * (w / (p * m)).
- Qwen3-VL ("qwen3"): `smart_resize` of video_processing_qwen3_vl.py, whose bounds are over all the video's frames
  (t * h * w), with `cap_pixels_per_frame` (VideoConfig.frame_cap) as epd_models/video.py `resized_size` applies it.
  The prompt also carries a time stamp and two vision tokens per temporal patch: not counted (a lower bound).
- LLaVA-OneVision ("uniform"): a fixed number of rows per frame (VideoConfig.frame_tokens: the vision tower's patch
  grid pooled 2x2, `apply_pooling`) and one `image_newline` row after the last frame.

Every count is what the video's embeddings hold, so the prompt holds at least that many tokens: a request whose
videos alone pass the model's length is refused before anything is encoded (proxy/video.py).
"""
from __future__ import annotations

import math

from epd_common.video import VideoError
from epd_common.video_sampling import VideoConfig


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's per-frame resize: (height, width) multiples of `factor` with min..max pixels, aspect kept."""
    _check_aspect(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's resize: the pixel bounds are over num_frames * height * width."""
    if num_frames < temporal_factor:
        raise VideoError(f"this model's video processor needs at least {temporal_factor} frames, got {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _check_aspect(height: int, width: int) -> None:
    if min(height, width) < 1 or max(height, width) / min(height, width) > 200:
        raise VideoError(f"a {width}x{height} frame cannot be resized for this model: its aspect ratio must be "
                         "under 200")


def video_rows(config: VideoConfig, width: int, height: int, num_frames: int, max_pixels: int) -> int | None:
    """Embedding rows of a `num_frames`-frame video of width x height frames sampled with the pixel budget
    `max_pixels`; None when `config` does not say its model's rule (a worker that does not report it). VideoError
    where the model's processor refuses the frames (an aspect ratio over 200, too few frames)."""
    t = config.temporal_patch
    if config.sampler == "uniform":
        return None if config.frame_tokens is None else num_frames * config.frame_tokens + 1
    if config.patch_size is None or config.merge_size is None:
        return None
    factor = config.patch_size * config.merge_size
    if config.sampler == "qwen2":
        h, w = smart_resize(height, width, factor, config.min_pixels, max_pixels)
    else:
        most = max_pixels
        if config.frame_cap is not None:  # Qwen3VLVideoProcessor.resize with cap_pixels_per_frame
            most = max(min(config.frame_cap, max_pixels // num_frames), int(config.min_pixels * 1.05)) * num_frames
        h, w = smart_resize_video(num_frames, height, width, t, factor, config.min_pixels, most)
    return -(-num_frames // t) * (h // factor) * (w // factor)
