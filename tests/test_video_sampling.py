"""epd_common.video_sampling against the transformers code it restates.

transformers' video processor modules import torchvision at the top, which cannot be installed here, so each
``sample_frames`` is compiled from the installed transformers source on its own (ast) and run with torch on a grid
of videos and settings: every result must be equal, and every failure of transformers a VideoError.
"""
from __future__ import annotations
import __future__

import ast
import itertools
import logging
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers.video_utils import default_sample_indices_fn

from epd_common.video import VideoError, VideoInfo
from epd_common.video_sampling import (
    VideoConfig,
    arange_float32,
    frame_indices,
    linspace_rounded,
    sample_indices,
    sample_indices_linspace,
    sample_indices_uniform,
    sampled_fps,
    target_frames,
)

TOTALS = [1, 2, 3, 4, 5, 7, 8, 10, 17, 30, 31, 49, 60, 97, 121, 299, 300, 301, 997, 1799, 3600, 36000]
VIDEO_FPS = [1.0, 7.5, 23.976, 25.0, 29.97, 30.0, 60.0]
FPS = [0.5, 1.0, 2.0, 3.7, 24.0]
NUM_FRAMES = [0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 64, 768, 1000]
MIN_MAX = [(4, 768), (1, 16), (8, 32)]


def transformers_method(module: str, cls: str, name: str) -> Callable[..., Any]:
    """`cls.name` of transformers' `module` (a path under the package), compiled without importing the module."""
    path = Path(transformers.__file__).parent / module
    tree = ast.parse(path.read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    func = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)
    code = compile(ast.Module(body=[func], type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict[str, Any] = {"torch": torch, "np": np, "math": math, "logger": logging.getLogger(__name__)}
    exec(code, namespace)
    return namespace[name]


QWEN2 = transformers_method("models/qwen2_vl/video_processing_qwen2_vl.py", "Qwen2VLVideoProcessor", "sample_frames")
QWEN3 = transformers_method("models/qwen3_vl/video_processing_qwen3_vl.py", "Qwen3VLVideoProcessor", "sample_frames")


def info(total: int, video_fps: float) -> VideoInfo:
    return VideoInfo(width=64, height=48, fps=video_fps, num_frames=total, duration_s=total / video_fps,
                     codec="h264", container="mov,mp4,m4a,3gp,3g2,mj2")


def reference(call: Callable[[], Any]) -> list[int] | None:
    """transformers' indices as ints, or None where it fails (or selects nothing, which fails later there)."""
    try:
        out = call()
    except (ValueError, ZeroDivisionError):
        return None
    indices = [int(i) for i in (out.tolist() if hasattr(out, "tolist") else out)]
    return indices or None


def ours(call: Callable[[], list[int]]) -> list[int] | None:
    try:
        return call()
    except VideoError:
        return None


def settings() -> list[tuple[int, float, float | None, int | None, tuple[int, int]]]:
    by_fps = [(t, v, f, None, mm) for t, v, f, mm in itertools.product(TOTALS, VIDEO_FPS, FPS, MIN_MAX)]
    by_count = [(t, 30.0, None, n, mm) for t, n, mm in itertools.product(TOTALS, NUM_FRAMES, MIN_MAX[:2])]
    return by_fps + by_count + [(t, 30.0, None, None, mm) for t in TOTALS for mm in MIN_MAX]


@pytest.mark.parametrize("temporal_patch_size", [1, 2])
def test_qwen2_vl_rule_matches_transformers(temporal_patch_size: int) -> None:
    checked = 0
    for total, video_fps, fps, num_frames, (lo, hi) in settings():
        if fps is None and num_frames is None:  # a TypeError in transformers; its processors default to fps=2
            assert sample_indices(info(total, video_fps)) == list(range(total))  # what its code goes on to do
            continue
        processor = SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=temporal_patch_size,
                                    min_frames=lo, max_frames=hi)
        metadata = SimpleNamespace(total_num_frames=total, fps=video_fps)
        expected = reference(lambda: QWEN2(processor, metadata, fps=fps, num_frames=num_frames))  # noqa: B023
        got = ours(lambda: sample_indices(info(total, video_fps), fps=fps, num_frames=num_frames,  # noqa: B023
                                          min_frames=lo, max_frames=hi, multiple_of=temporal_patch_size))  # noqa: B023
        assert got == expected, (total, video_fps, fps, num_frames, lo, hi)
        checked += expected is not None
    assert checked > 1000  # the grid mostly exercises successful sampling, not only refusals


def test_qwen3_vl_rule_matches_transformers() -> None:
    checked = 0
    for total, video_fps, fps, num_frames, (lo, hi) in settings():
        processor = SimpleNamespace(fps=None, min_frames=lo, max_frames=hi)
        metadata = SimpleNamespace(total_num_frames=total, fps=video_fps)
        expected = reference(lambda: QWEN3(processor, metadata, fps=fps, num_frames=num_frames))  # noqa: B023
        got = ours(lambda: sample_indices_linspace(info(total, video_fps), fps=fps, num_frames=num_frames,  # noqa: B023
                                                   min_frames=lo, max_frames=hi))  # noqa: B023
        if expected is not None and len(expected) > max(total, hi):
            assert got is None  # the one refusal transformers does not make: an unbounded num_frames
            continue
        assert got == expected, (total, video_fps, fps, num_frames, lo, hi)
        checked += expected is not None
    assert checked > 1000


def test_default_rule_matches_transformers() -> None:
    for total, video_fps, fps, num_frames, _ in settings():
        metadata: Any = SimpleNamespace(total_num_frames=total, fps=video_fps)
        expected = reference(lambda: default_sample_indices_fn(metadata, num_frames=num_frames, fps=fps))  # noqa: B023
        got = ours(lambda: sample_indices_uniform(info(total, video_fps), fps=fps, num_frames=num_frames))  # noqa: B023
        assert got == expected, (total, video_fps, fps, num_frames)


def test_fps_sampling_is_clamped_and_rounded_to_the_temporal_patch() -> None:
    ten_minutes = info(18_000, 30.0)
    assert len(sample_indices(ten_minutes, fps=2.0, max_frames=768, multiple_of=2)) == 768  # 1200 clamped
    assert len(sample_indices(info(30, 30.0), fps=2.0, min_frames=4, multiple_of=2)) == 4  # 2 raised to min
    assert len(sample_indices(info(95, 10.0), fps=1.0, multiple_of=2)) == 8  # 9.5 floored to a multiple of 2
    assert sample_indices(info(20, 10.0), num_frames=5, multiple_of=2) == [0, 5, 10, 15]  # round(2.5) * 2 = 4


@pytest.mark.parametrize("rule", [sample_indices, sample_indices_linspace, sample_indices_uniform])
def test_fps_and_num_frames_together_are_refused(rule: Callable[..., list[int]]) -> None:
    with pytest.raises(VideoError, match="mutually exclusive"):
        rule(info(100, 30.0), fps=2.0, num_frames=8)


def test_more_frames_than_the_video_has_are_refused() -> None:
    with pytest.raises(VideoError, match="cannot sample 12 frames"):
        sample_indices(info(10, 30.0), num_frames=12)
    with pytest.raises(VideoError, match="no frame"):
        sample_indices(info(1, 30.0), fps=2.0, multiple_of=2)  # transformers divides by zero here


CONFIGS = [VideoConfig("qwen2", 2, 3136, 200_704), VideoConfig("qwen3", 2, 4096, 200_000, min_frames=4, max_frames=64),
           VideoConfig("uniform", 1, 1, 10_000, fps=None, num_frames=None),
           VideoConfig("uniform", 1, 1, 10_000, fps=1.0)]
RULES = {"qwen2": lambda c, i, f: sample_indices(i, fps=f, min_frames=c.min_frames, max_frames=c.max_frames,
                                                 multiple_of=c.temporal_patch),
         "qwen3": lambda c, i, f: sample_indices_linspace(i, fps=f, min_frames=c.min_frames, max_frames=c.max_frames),
         "uniform": lambda c, i, f: sample_indices_uniform(i, fps=f)}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.sampler}-{c.fps}")
@pytest.mark.parametrize("total,video_fps", [(8, 4.0), (30, 30.0), (97, 24.0), (300, 29.97), (5, 1.0), (2000, 60.0)])
def test_a_planned_count_gives_the_frames_the_rule_gives_for_the_rate(config: VideoConfig, total: int,
                                                                       video_fps: float) -> None:
    """What the proxy plans (a frame count) and the encoder redoes from it are the family's own frames for the
    rate: the count is all the hash needs to name them."""
    video = info(total, video_fps)
    expected = ours(lambda: RULES[config.sampler](config, video, config.fps))
    if config.fps is None and total > config.max_frames:  # "every frame", clamped as a rate is
        expected = sample_indices_uniform(video, num_frames=config.max_frames)
    assert ours(lambda: frame_indices(config, video, target_frames(config, video))) == expected


def test_the_server_limit_clamps_a_rate_and_never_a_given_count() -> None:
    config, video = CONFIGS[0], info(3000, 30.0)  # 100 s at 2 fps: 200 frames
    assert target_frames(config, video) == 200
    assert target_frames(config, video, max_frames=33) == 32  # whole temporal patches
    assert target_frames(config, video, num_frames=40, max_frames=33) == 40  # the caller refuses it (400)
    assert len(frame_indices(config, video, 32)) == 32 and sampled_fps(video, 32) == pytest.approx(0.32)


def test_a_config_from_a_worker_is_checked() -> None:
    assert VideoConfig.from_dict(CONFIGS[1].as_dict()) == CONFIGS[1]
    for bad in ([], {"sampler": "qwen9", "temporal_patch": 2, "min_pixels": 1, "max_pixels": 2},
                {"sampler": "qwen2", "temporal_patch": 0, "min_pixels": 1, "max_pixels": 2},
                {"sampler": "qwen2", "temporal_patch": 2, "min_pixels": 1, "max_pixels": 2, "fps": float("nan")},
                {"sampler": "qwen2", "temporal_patch": 2, "min_pixels": 1, "max_pixels": 2, "evil": 1}):
        with pytest.raises(ValueError):
            VideoConfig.from_dict(bad)


@pytest.mark.parametrize("total", [1, 2, 3, 7, 16, 31, 100, 1001, 4097])
def test_the_numpy_free_index_helpers_equal_numpy(total: int) -> None:
    """The proxy image has no numpy: the plain-Python arange / linspace equal numpy's, value for value."""
    for n in range(1, min(total, 64) + 1):
        step = total / n
        size = math.ceil(total / step)
        expected = (np.arange(size, dtype=np.float64) * step).astype(np.float32).tolist()
        assert arange_float32(size, step) == expected, (total, n)
    for n in [*range(1, 70), 127, 768]:
        assert linspace_rounded(total - 1, n) == np.linspace(0, total - 1, n).round().astype(int).tolist(), (total, n)
