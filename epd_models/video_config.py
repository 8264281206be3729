"""A worker's video settings: its checkpoint's VideoConfig (how frames are sampled) and its server's VideoLimits.

`video_config(model_dir, family)` is what a worker reports in /health `model_identity["video"]` (the proxy plans
every video of the fleet with it) and what an encoder checks each chunk's plan against. It is the sampler and the
defaults of the family's transformers 5.24 video processor (FAMILY_DEFAULTS, each naming its class; a test reads
the class attributes from the transformers source), overridden by the checkpoint's video processor config where
it sets them (found as transformers finds it: epd_models/video.py `_video_processor_dict`), with the per-frame
pixel bounds and temporal patch `video_settings` gives the vision half, so the plan and the pixels agree.

Notes on the defaults, all transformers' own: Qwen2-VL's and LLaVA-OneVision's processors set no fps and no
num_frames (`do_sample_frames = False`: every frame given is used), so their default is every frame up to
max_frames (epd_common.video_sampling.target_frames); Qwen3-VL samples 2 per second. LLaVA-OneVision resizes each
frame to a fixed size (no pixel budget): its min and max pixels are that size's area, as `video_settings` says.

`add_video_flags` / `video_limits`: the --max-video-* flags an encoder (and an aggregated decoder) bounds the
videos it decodes with (epd_common.video.VideoLimits).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from epd_common.video import VideoLimits
from epd_common.video_sampling import Sampler, VideoConfig


@dataclass(frozen=True)
class FamilyDefaults:
    """The class attributes of a family's transformers video processor that sampling and resizing read."""

    processor: str  # the transformers class, for the reader (and the test that compares)
    sampler: Sampler
    size: dict[str, int]  # {"shortest_edge", "longest_edge"} (Qwen) or {"height", "width"} (fixed size)
    temporal_patch_size: int = 1  # (the three below: what `video_settings` falls back on)
    patch_size: int = 14
    merge_size: int = 1
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4  # Qwen's; the uniform sampler has none (used only as VideoConfig requires one)
    max_frames: int = 768


_QWEN2 = FamilyDefaults("Qwen2VLVideoProcessor", "qwen2", {"shortest_edge": 128 * 28 * 28,
                                                           "longest_edge": 28 * 28 * 768},
                        temporal_patch_size=2, patch_size=14, merge_size=2)
_QWEN3 = FamilyDefaults("Qwen3VLVideoProcessor", "qwen3", {"shortest_edge": 128 * 32 * 32,
                                                           "longest_edge": 32 * 32 * 768},
                        temporal_patch_size=2, patch_size=16, merge_size=2, fps=2)
FAMILY_DEFAULTS = {
    "qwen2_vl": _QWEN2,
    "qwen2_5_vl": _QWEN2,  # Qwen2.5-VL's processor uses Qwen2VLVideoProcessor
    "qwen2_5_omni": _QWEN2,  # so does Qwen2.5-Omni's, and it passes this size on every call
    "qwen3_vl": _QWEN3,
    "qwen3_vl_moe": _QWEN3,  # Qwen3-VL-MoE's processor uses Qwen3VLVideoProcessor
    "llava_onevision": FamilyDefaults("LlavaOnevisionVideoProcessor", "uniform", {"height": 384, "width": 384}),
}


def video_config(model_dir: str | Path, family: str) -> VideoConfig | None:
    """The checkpoint's video sampling settings; None when its family takes no video (not in VIDEO_FAMILIES).
    ValueError when its video processor config holds values a VideoConfig cannot (the worker does not start)."""
    # NOTE: here, not at the top: epd_models.video loads torch and transformers, and the workers' --help reads this
    # module's add_video_flags
    from epd_models.video import VIDEO_FAMILIES, _video_processor_dict, video_settings

    if family not in VIDEO_FAMILIES:
        return None
    defaults = FAMILY_DEFAULTS.get(family)
    if defaults is None:
        raise ValueError(f"no video sampling defaults for the {family} family")
    found = _video_processor_dict(Path(model_dir)) or {}
    settings = video_settings(model_dir, _image_processor(Path(model_dir), defaults), family)  # as the vision half's
    fixed = settings.frame_size is not None
    try:
        return VideoConfig(sampler=defaults.sampler, temporal_patch=settings.temporal_patch_size,
                           min_pixels=settings.min_pixels, max_pixels=settings.max_pixels,
                           fps=_number(found.get("fps", defaults.fps)),
                           num_frames=found.get("num_frames", defaults.num_frames),
                           min_frames=found.get("min_frames", defaults.min_frames),
                           max_frames=found.get("max_frames", defaults.max_frames),
                           patch_size=None if fixed else settings.patch_size,
                           merge_size=None if fixed else settings.merge_size, frame_cap=settings.frame_cap,
                           frame_tokens=_pooled_frame_rows(Path(model_dir)) if fixed else None)
    except (TypeError, ValueError) as exc:  # e.g. a string where a number belongs
        raise ValueError(f"video processor config of {model_dir}: {exc}") from exc


def _pooled_frame_rows(model_dir: Path) -> int | None:
    """LLaVA-OneVision's rows a video frame: its vision tower's patch grid pooled 2x2 (`apply_pooling`: each side
    ceil(side / 2)); None without a config.json (then the proxy counts no tokens)."""
    if not (model_dir / "config.json").is_file():
        return None
    from epd_models.registry import load_config  # here: the registry's adapters import this module's neighbours

    vision = load_config(model_dir).vision_config
    side = int(vision.image_size) // int(vision.patch_size)
    return math.ceil(side / 2) ** 2


def _image_processor(model_dir: Path, defaults: FamilyDefaults) -> SimpleNamespace:
    """What `video_settings` reads of the image processor (its fallback when the checkpoint has no video processor
    config), from processor_config.json's "image_processor" without loading it; the family's video defaults
    where that says nothing. (A preprocessor_config.json is read by `video_settings` as the video processor's.)"""
    from epd_models.video import _json

    nested = _json(model_dir / "processor_config.json") or {}
    found = nested.get("image_processor")
    image: dict[str, Any] = found if isinstance(found, dict) else {}
    size = image.get("size") or defaults.size
    if "min_pixels" in image or "max_pixels" in image:  # legacy keys, as Qwen2VLImageProcessor.__init__ reads them
        size = {"shortest_edge": image.get("min_pixels", size.get("shortest_edge")),
                "longest_edge": image.get("max_pixels", size.get("longest_edge"))}
    return SimpleNamespace(size=size, patch_size=image.get("patch_size", defaults.patch_size),
                           temporal_patch_size=image.get("temporal_patch_size", defaults.temporal_patch_size),
                           merge_size=image.get("merge_size", defaults.merge_size))


def _number(value: Any) -> Any:
    """JSON numbers as VideoConfig takes them (an int fps is a float); anything else as is, for it to refuse."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def add_video_flags(p: argparse._ActionsContainer, defaults: Any) -> None:
    """--max-video-duration, --max-video-frames, --max-video-frame-pixels, --max-video-decode-frames, with the
    worker config's defaults."""
    p.add_argument("--max-video-duration", type=float, default=defaults.max_video_duration,
                   help="seconds a video may last; longer videos get a 400 video_too_large")
    p.add_argument("--max-video-frames", type=int, default=defaults.max_video_frames,
                   help="sampled frames one video may have; more get a 400 video_too_large")
    p.add_argument("--max-video-frame-pixels", type=int, default=defaults.max_video_frame_pixels,
                   help="width x height of a video's frames above this is refused before decoding")
    p.add_argument("--max-video-decode-frames", type=int, default=defaults.max_video_decode_frames,
                   help="frames decoded for one video item (a chunk), from the keyframe before its first frame; "
                        "more get a 400 video_too_large, before decoding where the packet index tells")


def video_limits(cfg: Any, max_bytes: int) -> VideoLimits:
    """The VideoLimits of a worker config with the --max-video-* fields; `max_bytes`: its cap on one video's bytes."""
    return VideoLimits(max_bytes=max_bytes, max_duration_s=cfg.max_video_duration, max_frames=cfg.max_video_frames,
                       max_pixels_per_frame=cfg.max_video_frame_pixels, max_decode_frames=cfg.max_video_decode_frames)
