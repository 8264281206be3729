"""Sampled video frames -> the inputs Qwen2-VL / Qwen2.5-VL's video processor makes, without torchvision.

Every video processor in transformers 5 needs torchvision, which cannot be installed here, so this module does
what `Qwen2VLVideoProcessor._preprocess` does (transformers/models/qwen2_vl/video_processing_qwen2_vl.py; both
families use that class), step for step, with each frame going through the family's own PIL image processor:

1. `resize`: every frame to smart_resize(height, width, factor=patch_size * merge_size,
   min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]) of the VIDEO processor's size (one video
   is one tensor there, so all frames share one size); `cap_pixels_per_frame` off, its v5.24 default.
2. `rescale_and_normalize`: rescale_factor, image_mean, image_std, as the image path does.
3. `patchify`: the frame count padded to a multiple of temporal_patch_size by repeating the last frame, then
   (grid_t, T, C, gh/m, m, p, gw/m, m, p) permuted to rows (grid_t, gh/m, gw/m, m, m) x (C, T, p, p):
   `pixel_values_videos` (grid_t * grid_h * grid_w, C * T * p * p) and `video_grid_thw` (grid_t, grid_h, grid_w).
4. Qwen2.5-VL's processor adds second_per_grid_ts = temporal_patch_size / fps (processing_qwen2_5_vl.py,
   `_process_videos`, with the sampled fps): the seconds one temporal patch spans.

Steps 1-2 are the image processor called on the frames with temporal_patch_size=1: its rows are each frame's
(C, p, p) patches in the same spatial order, so step 3 only regroups them in time. What differs from the stock
video processor: resampling is PIL's bicubic (the image path) where it resizes tensors with torchvision's, and
frames arrive already sampled (its `sample_frames` is the caller's: epd_common/video.py).

The settings are the checkpoint's video processor config where it has one, found as transformers looks for it
(processor_config.json's "video_processor", then video_preprocessor_config.json, then preprocessor_config.json),
else the image processor's. Memory is bounded before any pixel work: the float32 tensors this makes are sized
from the frame size and count first.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

if TYPE_CHECKING:
    from PIL import Image

VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl")  # one temporal grid per video, no per-frame layout tokens
VIDEO_DEFAULT_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}  # Qwen2VLVideoProcessor.size
DEFAULT_MAX_BYTES = 1 << 30  # float32 pixel values one video may make (callers pass their server limit)
_WORKING_COPIES = 3  # the image processor's rows, the padded stack, the permuted rows: alive at once at most
_OVERRIDES = ("image_mean", "image_std", "rescale_factor")  # video processor keys passed on to the image path


class VideoError(ValueError):
    """Frames that cannot be made into this family's video inputs (the message says why): a 400."""


@dataclass(frozen=True)
class VideoSettings:
    """What the checkpoint's video processor resizes and patches frames with."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    overrides: tuple[tuple[str, Any], ...] = ()  # _OVERRIDES the video processor sets, for the image processor


@dataclass(frozen=True, eq=False)
class VideoInputs:
    """One video as the family's processor returns it (a batch of one)."""

    pixel_values_videos: torch.Tensor  # (grid_t * grid_h * grid_w, C * temporal_patch_size * patch * patch)
    video_grid_thw: tuple[int, int, int]
    second_per_grid_t: float  # temporal_patch_size / fps (Qwen2.5-VL's second_per_grid_ts entry)


def video_settings(model_dir: str | Path, image_processor: Any) -> VideoSettings:
    """The checkpoint's video processor settings, else its image processor's."""
    found = _video_processor_dict(Path(model_dir))
    if found is None:
        size = dict(image_processor.size)
        return VideoSettings(int(size["shortest_edge"]), int(size["longest_edge"]), int(image_processor.patch_size),
                             int(image_processor.temporal_patch_size), int(image_processor.merge_size))
    size = dict(found.get("size") or VIDEO_DEFAULT_SIZE)
    # as Qwen2VLVideoProcessor.__init__: top-level min_pixels / max_pixels override size (old configs nest them)
    least = found.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
    most = found.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
    settings = VideoSettings(
        min_pixels=_positive(least, "min_pixels"), max_pixels=_positive(most, "max_pixels"),
        patch_size=_positive(found.get("patch_size", image_processor.patch_size), "patch_size"),
        temporal_patch_size=_positive(found.get("temporal_patch_size", image_processor.temporal_patch_size),
                                      "temporal_patch_size"),
        merge_size=_positive(found.get("merge_size", image_processor.merge_size), "merge_size"),
        overrides=tuple((k, found[k]) for k in _OVERRIDES if found.get(k) is not None))
    if settings.min_pixels > settings.max_pixels:
        raise ValueError(f"video processor config of {model_dir}: min_pixels {least} > max_pixels {most}")
    return settings


def video_inputs(image_processor: Any, settings: VideoSettings, frames: list[Image.Image], fps: float,
                 max_pixels: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> VideoInputs:
    """The video processor's pixel_values_videos, video_grid_thw and second_per_grid_t for `frames` (sampled at
    `fps` frames per second). `max_pixels`: a per-frame pixel budget instead of the checkpoint's (the caller keeps
    it within its limits). VideoError before any pixel work when the result would be over `max_bytes`."""
    if not frames:
        raise VideoError("a video needs at least one frame")
    if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
        raise VideoError(f"fps must be a finite number > 0, got {fps!r}")
    width, height = frames[0].size
    if any(f.size != (width, height) for f in frames):
        raise VideoError(f"all frames of a video must have one size; the first is {width}x{height}")
    most = settings.max_pixels if max_pixels is None else max_pixels
    if not 0 < settings.min_pixels <= most:
        raise VideoError(f"max_pixels {most} is under the model's minimum of {settings.min_pixels} per frame")
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    try:
        rh, rw = smart_resize(height, width, factor=p * m, min_pixels=settings.min_pixels, max_pixels=most)
    except (ValueError, ZeroDivisionError) as exc:  # an aspect ratio over 200, or an empty frame
        raise VideoError(f"frame size {width}x{height}: {exc}") from exc
    num_frames = len(frames) + (-len(frames) % t)  # step 3's padding
    channels = 3  # RGB, as the image processor converts (do_convert_rgb)
    nbytes = _WORKING_COPIES * num_frames * channels * rh * rw * 4
    if nbytes > max_bytes:
        raise VideoError(f"{len(frames)} frames at {rw}x{rh} make {nbytes} bytes of pixel values, over the "
                         f"limit of {max_bytes}: send fewer frames or a lower max_pixels")
    # steps 1-2: the image path, one frame a row block, each frame's rows (C * p * p) in the video's spatial order
    out = image_processor(images=frames, size={"shortest_edge": settings.min_pixels, "longest_edge": most},
                          patch_size=p, merge_size=m, temporal_patch_size=1, return_tensors="np",
                          **dict(settings.overrides))
    rows, grids = np.asarray(out["pixel_values"], dtype=np.float32), np.asarray(out["image_grid_thw"])
    grid_h, grid_w = rh // p, rw // p
    assert (grids == [1, grid_h, grid_w]).all(), f"image processor grids {grids[:2]} != {(1, grid_h, grid_w)}"
    return VideoInputs(temporal_patches(rows, len(frames), t, p), (num_frames // t, grid_h, grid_w), t / fps)


def temporal_patches(rows: np.ndarray, num_frames: int, temporal_patch_size: int, patch_size: int) -> torch.Tensor:
    """Per-frame patch rows (num_frames * N, C * p * p), frame after frame -> the video's rows
    (grid_t * N, C * T * p * p): the last frame repeated up to whole temporal patches, then each spatial patch's
    T frames side by side within each channel (video_processing_qwen2_vl.py `patchify`: (.., C, T, ph, pw))."""
    t = temporal_patch_size
    per_frame = rows.reshape(num_frames, -1, rows.shape[-1])  # (F, N, C * p * p)
    if pad := -num_frames % t:
        per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], pad, axis=0)])
    grid_t, n, flat = per_frame.shape[0] // t, per_frame.shape[1], per_frame.shape[2]
    area = patch_size * patch_size
    channels_first = per_frame.reshape(grid_t, t, n, flat // area, area)  # (grid_t, T, N, C, p * p)
    video = channels_first.transpose(0, 2, 3, 1, 4)  # (grid_t, N, C, T, p * p)
    return torch.from_numpy(np.ascontiguousarray(video).reshape(grid_t * n, t * flat))


def _video_processor_dict(model_dir: Path) -> dict[str, Any] | None:
    """The video processor's config as transformers finds it (video_processing_utils.py `get_video_processor_dict`):
    nested in processor_config.json, else video_preprocessor_config.json, else preprocessor_config.json."""
    nested = _json(model_dir / "processor_config.json")
    if nested is not None and isinstance(nested.get("video_processor"), dict):
        return dict(nested["video_processor"])
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        found = _json(model_dir / name)
        if found is not None:
            return found
    return None


def _json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"video processor config: {name} must be a positive int, got {value!r}")
    return value
