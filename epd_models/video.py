"""Sampled video frames -> the inputs each family's video processor makes, without torchvision.

Every video processor in transformers 5 needs torchvision, which cannot be installed here, so the families'
video preprocessing is done here (and in epd_models/video_qwen3.py, epd_models/video_onevision.py) step for step,
each frame going through the family's own PIL image path:

Qwen2-VL / Qwen2.5-VL (`Qwen2VLVideoProcessor._preprocess`, video_processing_qwen2_vl.py; both use that class) and
Qwen3-VL (`Qwen3VLVideoProcessor._preprocess`, video_processing_qwen3_vl.py), which differ only in step 1:

1. `resize`: every frame to one size (one video is one tensor there). Qwen2: smart_resize(height, width,
   factor=patch_size * merge_size, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]), bounds per
   frame, `cap_pixels_per_frame` off (its v5.24 default). Qwen3: its own smart_resize(num_frames, height, width,
   temporal_factor=temporal_patch_size, ...), whose bounds are over ALL the video's frames (t * h * w), so a
   frame's size depends on how many frames the whole video has (`pixels_per_video`; a chunk is sized by its
   video's count), with `cap_pixels_per_frame` applied where the config turns it on.
2. `rescale_and_normalize`: rescale_factor, image_mean, image_std, as the image path does.
3. `patchify`: the frame count padded to a multiple of temporal_patch_size by repeating the last frame, then
   (grid_t, T, C, gh/m, m, p, gw/m, m, p) permuted to rows (grid_t, gh/m, gw/m, m, m) x (C, T, p, p):
   `pixel_values_videos` (grid_t * grid_h * grid_w, C * T * p * p) and `video_grid_thw` (grid_t, grid_h, grid_w).
4. second_per_grid_t = temporal_patch_size / fps (Qwen2.5-VL's second_per_grid_ts, processing_qwen2_5_vl.py
   `_process_videos`, with the sampled fps): the seconds one temporal patch spans. Qwen3-VL writes its times as
   text instead (epd_models/video_qwen3.py).

Step 1's resampling is done here (PIL, the image path's own: bicubic), steps 2-3 are the image processor called on
the resized frames with do_resize=False and temporal_patch_size=1: its rows are each frame's (C, p, p) patches in
the video's spatial order, so step 3 only regroups them in time. What differs from the stock video processor:
resampling is PIL's where it resizes tensors with torchvision's, and frames arrive already sampled (its
`sample_frames` is the caller's: epd_common/video.py, epd_common/video_sampling.py).

A video may come in chunks (`VideoClip`: frames [first, first + n) of its sampled frames, whole temporal patches
except the last chunk): each chunk's inputs are exactly its frames' part of the whole video's, because the size
is the whole video's (Qwen3: from `total_frames`) and only the last chunk is padded, as the whole video is.

The settings are the checkpoint's video processor config where it has one, found as transformers looks for it
(processor_config.json's "video_processor", then video_preprocessor_config.json, then preprocessor_config.json),
else the image processor's (Qwen3-VL: its video processor's default size, since its bounds mean another thing).
Memory is bounded before any pixel work: the float32 tensors made are sized from the frame size and count first.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as smart_resize_video

if TYPE_CHECKING:
    from PIL import Image

VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava_onevision", "qwen2_5_omni")
QWEN3_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")  # Qwen3VLVideoProcessor's rules (Qwen3-VL-MoE's processor is Qwen3-VL's)
VIDEO_DEFAULT_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}  # Qwen2VLVideoProcessor.size
QWEN3_VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}  # Qwen3VLVideoProcessor.size
QWEN3_MAX_VIDEO_TOKENS = 768  # Qwen3VLVideoProcessor.max_video_tokens (its per-frame cap, when turned on)
DEFAULT_MAX_BYTES = 1 << 30  # float32 pixel values one video may make (callers pass their server limit)
_WORKING_COPIES = 3  # the image processor's rows, the padded stack, the permuted rows: alive at once at most
_OVERRIDES = ("image_mean", "image_std", "rescale_factor", "resample")  # video processor keys the image path takes


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
    # Qwen3-VL: min/max_pixels bound all the video's frames together (t * h * w), not each frame
    pixels_per_video: bool = False
    frame_cap: int | None = None  # Qwen3-VL's cap_pixels_per_frame: at most this many pixels a frame (else None)
    frame_size: tuple[int, int] | None = None  # LLaVA-OneVision: (height, width) every frame is resized to


@dataclass(frozen=True, eq=False)
class VideoClip:
    """Sampled frames handed to the encoder: a whole video, or a chunk of one (frames [first, first + n) of its
    sampled frames). A VideoError (a 400) when they cannot be one."""

    frames: Sequence[Image.Image]
    fps: float  # the sampled frames' rate (the whole video's)
    max_pixels: int | None = None  # the per-request pixel budget instead of the checkpoint's (its size's longest_edge)
    max_bytes: int = DEFAULT_MAX_BYTES
    frame_times: tuple[float, ...] | None = None  # each frame's time in the source video (seconds)
    total_frames: int | None = None  # the whole video's sampled frames; None: these frames are all of them
    last: bool = True  # the frames end the video (only its last chunk is padded; OneVision's newline row)

    def __post_init__(self) -> None:
        n = len(self.frames)
        if not n:
            raise VideoError("a video needs at least one frame")
        if not (isinstance(self.fps, (int, float)) and math.isfinite(self.fps) and self.fps > 0):
            raise VideoError(f"fps must be a finite number > 0, got {self.fps!r}")
        width, height = self.frames[0].size
        if any(f.size != (width, height) for f in self.frames):
            raise VideoError(f"all frames of a video must have one size; the first is {width}x{height}")
        if self.frame_times is not None and (len(self.frame_times) != n or not all(
                isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 for t in self.frame_times)):
            raise VideoError(f"frame_times must be {n} finite times >= 0, one per frame")
        total = self.total_frames
        if total is not None and (isinstance(total, bool) or not isinstance(total, int)
                                  or total < n or (total == n and not self.last)):
            raise VideoError(f"total_frames {total!r} cannot hold a chunk of {n} frames (last={self.last})")

    @property
    def video_frames(self) -> int:
        """The whole video's sampled frame count."""
        return self.total_frames if self.total_frames is not None else len(self.frames)

    @property
    def is_whole(self) -> bool:
        return self.last and self.video_frames == len(self.frames)

    def times(self) -> list[float]:
        """Each frame's time: `frame_times`, else (a whole video only) frame k at k / fps."""
        if self.frame_times is not None:
            return list(self.frame_times)
        if not self.is_whole:
            raise VideoError("a chunk of a video needs its frames' times (frame_times)")
        return [k / self.fps for k in range(len(self.frames))]


@dataclass(frozen=True, eq=False)
class VideoInputs:
    """One video (or chunk) as the family's processor returns it (a batch of one)."""

    pixel_values_videos: torch.Tensor  # (grid_t * grid_h * grid_w, C * temporal_patch_size * patch * patch)
    video_grid_thw: tuple[int, int, int]
    second_per_grid_t: float  # temporal_patch_size / fps (Qwen2.5-VL's second_per_grid_ts entry)


def video_settings(model_dir: str | Path, image_processor: Any, family: str = "qwen2_vl") -> VideoSettings:
    """The checkpoint's video processor settings for `family`, else its image processor's."""
    found = _video_processor_dict(Path(model_dir))
    if family == "llava_onevision":
        return _onevision_settings(model_dir, found, image_processor)
    if family == "qwen2_5_omni":  # Qwen2_5OmniProcessor passes its videos_kwargs size (the default) on every call
        found = {k: v for k, v in (found or {}).items() if k not in ("size", "min_pixels", "max_pixels")}
    if found is None:
        if family in QWEN3_FAMILIES:
            found = {"size": QWEN3_VIDEO_SIZE}
        else:
            size = dict(image_processor.size)
            return VideoSettings(int(size["shortest_edge"]), int(size["longest_edge"]),
                                 int(image_processor.patch_size), int(image_processor.temporal_patch_size),
                                 int(image_processor.merge_size))
    size = dict(found.get("size") or (QWEN3_VIDEO_SIZE if family in QWEN3_FAMILIES else VIDEO_DEFAULT_SIZE))
    least, most = size.get("shortest_edge", size.get("min_pixels")), size.get("longest_edge", size.get("max_pixels"))
    if family not in QWEN3_FAMILIES:  # Qwen2VLVideoProcessor.__init__: top-level min_pixels / max_pixels override size
        least, most = found.get("min_pixels", least), found.get("max_pixels", most)
    patch = _positive(found.get("patch_size", image_processor.patch_size), "patch_size")
    merge = _positive(found.get("merge_size", image_processor.merge_size), "merge_size")
    cap = None
    if family in QWEN3_FAMILIES and found.get("cap_pixels_per_frame"):  # Qwen3VLVideoProcessor.resize
        cap = _positive(found.get("max_video_tokens", QWEN3_MAX_VIDEO_TOKENS), "max_video_tokens") * (patch * merge)**2
    settings = VideoSettings(
        min_pixels=_positive(least, "min_pixels"), max_pixels=_positive(most, "max_pixels"), patch_size=patch,
        temporal_patch_size=_positive(found.get("temporal_patch_size", image_processor.temporal_patch_size),
                                      "temporal_patch_size"),
        merge_size=merge, overrides=_overrides(found), pixels_per_video=family in QWEN3_FAMILIES, frame_cap=cap)
    if settings.min_pixels > settings.max_pixels:
        raise ValueError(f"video processor config of {model_dir}: min_pixels {least} > max_pixels {most}")
    return settings


def _onevision_settings(model_dir: str | Path, found: dict[str, Any] | None, image_processor: Any) -> VideoSettings:
    """LLaVA-OneVision's video processor resizes every frame to size (height, width), the vision tower's input."""
    size = dict((found or {}).get("size") or image_processor.size)
    if "height" not in size or "width" not in size:
        raise ValueError(f"video processor config of {model_dir}: size {size} has no height and width")
    height, width = _positive(size["height"], "height"), _positive(size["width"], "width")
    return VideoSettings(height * width, height * width, 1, 1, 1, overrides=_overrides(found or {}),
                         frame_size=(height, width))


def _overrides(found: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, found[k]) for k in _OVERRIDES if found.get(k) is not None)


def video_inputs(image_processor: Any, settings: VideoSettings, frames: Sequence[Image.Image], fps: float,
                 max_pixels: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES, total_frames: int | None = None,
                 last: bool = True) -> VideoInputs:
    """The Qwen video processor's pixel_values_videos, video_grid_thw and second_per_grid_t for `frames` (sampled
    at `fps` frames per second; the whole video, or a chunk of `total_frames`). `max_pixels`: the size's
    longest_edge instead of the checkpoint's (the caller keeps it within its limits). VideoError before any pixel
    work when the result would be over `max_bytes`."""
    clip = VideoClip(frames, fps, max_pixels, max_bytes, total_frames=total_frames, last=last)
    return qwen_video_inputs(image_processor, settings, clip)


def qwen_video_inputs(image_processor: Any, settings: VideoSettings, clip: VideoClip) -> VideoInputs:
    """`video_inputs` of a VideoClip."""
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    frames = clip.frames
    if not clip.last and len(frames) % t:
        raise VideoError(f"a chunk that does not end its video must be whole temporal patches of {t} frames, "
                         f"got {len(frames)}")
    rh, rw = resized_size(settings, *frames[0].size, clip.video_frames, clip.max_pixels)
    num_frames = len(frames) + (-len(frames) % t)  # step 3's padding
    channels = 3  # RGB, as the image processor converts (do_convert_rgb)
    check_bytes(_WORKING_COPIES * num_frames * channels * rh * rw * 4, len(frames), rw, rh, clip.max_bytes)
    overrides = dict(settings.overrides)
    resample = overrides.pop("resample", image_processor.resample)
    resized = [f.convert("RGB").resize((rw, rh), resample) for f in frames]  # step 1, the image path's PIL resize
    # step 2: the image path, one frame a row block, each frame's rows (C * p * p) in the video's spatial order
    out = image_processor(images=resized, do_resize=False, patch_size=p, merge_size=m, temporal_patch_size=1,
                          return_tensors="np", **overrides)
    rows, grids = np.asarray(out["pixel_values"], dtype=np.float32), np.asarray(out["image_grid_thw"])
    grid_h, grid_w = rh // p, rw // p
    assert (grids == [1, grid_h, grid_w]).all(), f"image processor grids {grids[:2]} != {(1, grid_h, grid_w)}"
    return VideoInputs(temporal_patches(rows, len(frames), t, p), (num_frames // t, grid_h, grid_w), t / clip.fps)


def resized_size(settings: VideoSettings, width: int, height: int, video_frames: int,
                 max_pixels: int | None = None) -> tuple[int, int]:
    """(height, width) every frame of a `video_frames`-frame video is resized to (step 1)."""
    most = settings.max_pixels if max_pixels is None else max_pixels
    if not 0 < settings.min_pixels <= most:
        raise VideoError(f"max_pixels {most} is under the model's minimum of {settings.min_pixels}")
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    try:
        if not settings.pixels_per_video:
            return smart_resize(height, width, factor=p * m, min_pixels=settings.min_pixels, max_pixels=most)
        if video_frames < t:  # the video processor's smart_resize refuses it too
            raise VideoError(f"this model's video processor needs at least {t} frames, got {video_frames}")
        if settings.frame_cap is not None:  # Qwen3VLVideoProcessor.resize with cap_pixels_per_frame
            per_frame = max(min(settings.frame_cap, most // video_frames), int(settings.min_pixels * 1.05))
            most = per_frame * video_frames
        return smart_resize_video(video_frames, height, width, temporal_factor=t, factor=p * m,
                                  min_pixels=settings.min_pixels, max_pixels=most)
    except (ValueError, ZeroDivisionError) as exc:  # an aspect ratio over 200, or an empty frame
        if isinstance(exc, VideoError):
            raise
        raise VideoError(f"frame size {width}x{height}: {exc}") from exc


def check_bytes(nbytes: int, num_frames: int, width: int, height: int, max_bytes: int) -> None:
    if nbytes > max_bytes:
        raise VideoError(f"{num_frames} frames at {width}x{height} make {nbytes} bytes of pixel values, over the "
                         f"limit of {max_bytes}: send fewer frames or a lower max_pixels")


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
