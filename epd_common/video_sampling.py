"""Which frames of a video to decode: the sampling rules of transformers' video processors, without torch.

transformers 5.24's video processors need torchvision (which cannot be installed here), so their
``sample_frames`` rules are restated here, each citing the code it mirrors; tests/test_video_sampling.py runs the
transformers source of each rule (with torch) against these. Where transformers would fail (fps and num_frames
both given, more frames than the rule allows, zero frames) these raise VideoError, so a request gets a 400.
"""
from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass
from typing import Any, Literal

from epd_common.video import VideoError, VideoInfo

Sampler = Literal["qwen2", "qwen3", "uniform"]  # sample_indices, sample_indices_linspace, sample_indices_uniform


@dataclass(frozen=True)
class VideoConfig:
    """A family's video sampling settings, from its checkpoint's video processor config (epd_models/
    video_config.py reads them). Workers report them in /health `model_identity.video` as a dict; the proxy plans
    with them and an encoder checks its chunks with its own."""

    sampler: Sampler
    temporal_patch: int  # frames per temporal patch (1: every frame is its own, LLaVA-OneVision)
    min_pixels: int  # pixel bounds of the resize: per frame, or over the whole video for Qwen3-VL
    max_pixels: int
    fps: float | None = 2.0  # the processor's default sampling rate; None: its num_frames, else every frame
    num_frames: int | None = None  # the processor's default frame count (when fps is None)
    min_frames: int = 4
    max_frames: int = 768
    # how many tokens a video makes (epd_common/video_tokens.py; None: not reported, the proxy does not count)
    patch_size: int | None = None  # Qwen: pixels a patch side
    merge_size: int | None = None  # Qwen: patches merged a token side
    frame_cap: int | None = None  # Qwen3-VL's cap_pixels_per_frame: pixels a frame at most
    frame_tokens: int | None = None  # LLaVA-OneVision: rows a frame (a fixed size), plus one newline row a video

    def __post_init__(self) -> None:
        if self.sampler not in ("qwen2", "qwen3", "uniform"):
            raise ValueError(f"unknown video sampler {self.sampler!r}")
        for name in ("temporal_patch", "min_pixels", "max_pixels", "min_frames", "max_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VideoConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("patch_size", "merge_size", "frame_cap", "frame_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"VideoConfig.{name} must be an int >= 1 or null, got {value!r}")
        if self.fps is not None and not (isinstance(self.fps, (int, float)) and math.isfinite(self.fps)
                                         and self.fps > 0):
            raise ValueError(f"VideoConfig.fps must be a finite number > 0, got {self.fps!r}")
        if self.num_frames is not None and (isinstance(self.num_frames, bool) or self.num_frames < 1):
            raise ValueError(f"VideoConfig.num_frames must be >= 1, got {self.num_frames!r}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> VideoConfig:
        """From a worker's /health (ValueError when it is not one)."""
        if not isinstance(data, dict):
            raise ValueError("a video config must be an object")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"not a video config: {exc}") from exc


def target_frames(config: VideoConfig, info: VideoInfo, fps: float | None = None, num_frames: int | None = None,
                  max_frames: int | None = None) -> int:
    """The sampler's frame count for `info`: a request's `num_frames` as given, else the count its `fps` (or the
    config's fps, or the config's num_frames) gives by the family's rule, clamped to `max_frames` (the server's
    limit) like the rule clamps to its own. frame_indices(config, info, n) gives the frames."""
    if fps is not None and num_frames is not None:
        raise VideoError("num_frames and fps are mutually exclusive")
    if num_frames is not None:
        return num_frames
    top = min(config.max_frames, max_frames or config.max_frames)
    rate = fps if fps is not None else config.fps
    total, t = info.num_frames, config.temporal_patch
    if rate is None:
        n = min(config.num_frames if config.num_frames is not None else total, top)
        return max(t, n // t * t) if config.sampler == "qwen2" else max(1, n)
    if config.sampler == "qwen2":  # sample_indices with fps
        most = math.floor(min(top, total) / t) * t
        return max(t, math.floor(min(max(total / info.fps * rate, config.min_frames), most, total) / t) * t)
    if config.sampler == "qwen3":  # sample_indices_linspace with fps
        return max(1, min(max(int(total / info.fps * rate), config.min_frames), top, total))
    return max(1, min(int(total / info.fps * rate), top))  # sample_indices_uniform with fps


def frame_indices(config: VideoConfig, info: VideoInfo, num_frames: int) -> list[int]:
    """The frames the family's rule samples for the frame count `num_frames` (VideoError when it cannot)."""
    if config.sampler == "qwen2":
        return sample_indices(info, num_frames=num_frames, multiple_of=config.temporal_patch)
    if config.sampler == "qwen3":
        return sample_indices_linspace(info, num_frames=num_frames, max_frames=config.max_frames)
    return sample_indices_uniform(info, num_frames=num_frames)


def sampled_fps(info: VideoInfo, num_sampled: int) -> float:
    """Frames per second of the sampled sequence (transformers' VideoMetadata.sampled_fps)."""
    return num_sampled / info.num_frames * info.fps


def sample_indices(info: VideoInfo, fps: float | None = None, num_frames: int | None = None, min_frames: int = 4,
                   max_frames: int = 768, multiple_of: int = 1) -> list[int]:
    """Frame indices to decode, by the rule of transformers 5.24 ``Qwen2VLVideoProcessor.sample_frames``.

    (models/qwen2_vl/video_processing_qwen2_vl.py; Qwen2.5-VL uses the same processor.) `multiple_of` is the
    processor's ``temporal_patch_size``. With `num_frames`: rounded (Python's round) to a multiple, not clamped.
    With `fps`: ``total / video_fps * fps`` clamped to [min_frames, min(max_frames, total) floored to a multiple],
    then floored to a multiple. With neither: every frame (transformers means that, but raises a TypeError before;
    its processors default to fps=2). Indices are ``torch.arange(0, total, total / n).int()``,
    i.e. float32 values truncated (`arange_float32`). Where transformers would fail (both given, more frames
    than the video has, or zero frames: a ZeroDivisionError there) this raises VideoError.
    """
    if fps is not None and num_frames is not None:
        raise VideoError("num_frames and fps are mutually exclusive")
    total = info.num_frames
    if num_frames is not None:
        n = round(num_frames / multiple_of) * multiple_of
    elif fps is not None:
        top = math.floor(min(max_frames, total) / multiple_of) * multiple_of
        wanted = min(max(total / info.fps * fps, min_frames), top, total)
        n = math.floor(wanted / multiple_of) * multiple_of
    else:
        return list(range(total))
    _check_sample_count(n, total)
    step = total / n
    size = math.ceil(total / step)  # torch.arange's length, which can be n + 1
    return [int(v) for v in arange_float32(size, step)]


def arange_float32(size: int, step: float) -> list[float]:
    """``(np.arange(size, dtype=float64) * step).astype(float32)``: each product rounded to the nearest float32.

    Plain Python (struct's "f" rounds as numpy's cast does), so the torch-free proxy image carries no numpy;
    tests/test_video_sampling.py checks it against numpy."""
    return [struct.unpack("f", struct.pack("f", i * step))[0] for i in range(size)]


def linspace_rounded(stop: int, n: int) -> list[int]:
    """``np.linspace(0, stop, n).round().astype(int)`` for n >= 1: ``i * (stop / (n - 1))``, the last exactly
    `stop`, rounded half to even (Python's round, as numpy's)."""
    if n == 1:
        return [0]
    step = stop / (n - 1)
    return [round(i * step) for i in range(n - 1)] + [stop]


def sample_indices_linspace(info: VideoInfo, fps: float | None = None, num_frames: int | None = None,
                            min_frames: int = 4, max_frames: int = 768) -> list[int]:
    """Frame indices by the rule of transformers 5.24 ``Qwen3VLVideoProcessor.sample_frames``.

    (models/qwen3_vl/video_processing_qwen3_vl.py.) With `fps`: ``int(total / video_fps * fps)`` clamped to
    [min_frames, max_frames] and to the frame count; with neither: every frame clamped the same way;
    `num_frames` is used as given. Indices are ``np.linspace(0, total - 1, n).round()`` (half to even), so a
    video shorter than n frames has frames repeated; the processor itself pads the frames to a multiple of its
    temporal_patch_size. Unlike transformers, n over both the frame count and max_frames is refused (a request's
    num_frames must not make an unbounded list).
    """
    if fps is not None and num_frames is not None:
        raise VideoError("num_frames and fps are mutually exclusive")
    total = info.num_frames
    if num_frames is None and fps is not None:
        num_frames = min(max(int(total / info.fps * fps), min_frames), max_frames, total)
    n = num_frames if num_frames is not None else min(max(total, min_frames), max_frames)
    _check_sample_count(n, max(total, max_frames))  # n > total repeats frames, as in transformers
    return linspace_rounded(total - 1, n)


def sample_indices_uniform(info: VideoInfo, fps: float | None = None, num_frames: int | None = None) -> list[int]:
    """Frame indices by transformers 5.24 ``default_sample_indices_fn`` (video_utils.py; the default
    ``BaseVideoProcessor.sample_frames``, used by LLaVA-OneVision): ``arange(n) * total // n``, where `fps` gives
    ``n = max(1, int(total / video_fps * fps))``; with neither, every frame."""
    if fps is not None and num_frames is not None:
        raise VideoError("num_frames and fps are mutually exclusive")
    total = info.num_frames
    if num_frames is None and fps is not None:
        num_frames = max(1, int(total / info.fps * fps))
    if num_frames is None:
        return list(range(total))
    _check_sample_count(num_frames, total)
    return [i * total // num_frames for i in range(num_frames)]


def _check_sample_count(n: int, most: int) -> None:
    if n < 1:
        raise VideoError("the sampling settings select no frame of this video")
    if n > most:
        raise VideoError(f"cannot sample {n} frames from this video (at most {most})")
