"""A checkpoint's VideoConfig (epd_models/video_config.py): the family's transformers video processor defaults, the
checkpoint's video processor config over them, the pixel bounds its vision half resizes with, in /health."""
from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import transformers

from epd_common.video_sampling import VideoConfig
from epd_models.halves import VisionHalf
from epd_models.identity import model_identity
from epd_models.video import VIDEO_FAMILIES
from epd_models.video_config import FAMILY_DEFAULTS, video_config

SOURCES = {"Qwen2VLVideoProcessor": "models/qwen2_vl/video_processing_qwen2_vl.py",
           "Qwen3VLVideoProcessor": "models/qwen3_vl/video_processing_qwen3_vl.py",
           "LlavaOnevisionVideoProcessor": "models/llava_onevision/video_processing_llava_onevision.py"}


def class_attributes(cls: str) -> dict[str, Any]:
    """The constant class attributes of a transformers video processor, read from its source (the module imports
    torchvision, which cannot be installed here)."""
    tree = ast.parse((Path(transformers.__file__).parent / SOURCES[cls]).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    found: dict[str, Any] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            try:  # literals and arithmetic on them (128 * 28 * 28); names (IMAGENET_STANDARD_MEAN) are skipped
                found[stmt.targets[0].id] = eval(compile(ast.Expression(stmt.value), cls, "eval"),  # noqa: S307
                                                 {"__builtins__": {}})
            except NameError:
                pass
    return found


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
def test_the_defaults_are_the_transformers_video_processors(family: str) -> None:
    ours = FAMILY_DEFAULTS[family]
    theirs = class_attributes(ours.processor)
    assert ours.size == {k: int(v) for k, v in theirs["size"].items()}
    for name in ("fps", "num_frames", "min_frames", "max_frames", "temporal_patch_size", "patch_size", "merge_size"):
        if name in theirs:
            assert getattr(ours, name) == theirs[name], name
        elif name in ("fps", "num_frames"):  # not set there: None (the base class sets neither)
            assert getattr(ours, name) is None, name


def test_a_family_without_video_has_none(tmp_path: Path) -> None:
    assert video_config(tmp_path, "llava") is None and video_config(tmp_path, "gemma3") is None


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision"])
def test_tiny_checkpoints_agree_with_their_vision_half_and_report_it(tiny_model_dirs: dict[str, Path],
                                                                     family: str) -> None:
    """The pixel bounds and temporal patch the proxy plans with are the ones the encoder resizes with."""
    model_dir = tiny_model_dirs[family]
    config = video_config(model_dir, family)
    assert family in VIDEO_FAMILIES and config is not None
    settings = VisionHalf(model_dir).video_settings
    assert (config.min_pixels, config.max_pixels, config.temporal_patch) == (
        settings.min_pixels, settings.max_pixels, settings.temporal_patch_size)
    defaults = FAMILY_DEFAULTS[family]
    assert (config.sampler, config.fps, config.num_frames) == (defaults.sampler, defaults.fps, defaults.num_frames)
    reported = model_identity(model_dir)["video"]
    assert json.loads(json.dumps(reported)) == reported and VideoConfig.from_dict(reported) == config


def test_the_checkpoints_video_processor_config_overrides_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {
        "fps": 1, "min_frames": 2, "max_frames": 64, "temporal_patch_size": 2,
        "size": {"shortest_edge": 3136, "longest_edge": 100352}}}))
    assert video_config(tmp_path, "qwen2_vl") == VideoConfig(sampler="qwen2", temporal_patch=2, min_pixels=3136,
                                                             max_pixels=100352, fps=1.0, min_frames=2, max_frames=64,
                                                             patch_size=14, merge_size=2)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"num_frames": 16, "fps": None}}))
    config = video_config(tmp_path, "qwen3_vl")
    assert config is not None and (config.sampler, config.fps, config.num_frames) == ("qwen3", None, 16)
    assert (config.min_pixels, config.max_pixels) == (128 * 32 * 32, 32 * 32 * 768)  # Qwen3VLVideoProcessor.size


def test_legacy_and_fallback_configs(tmp_path: Path) -> None:
    """A legacy preprocessor_config.json is read as the video processor's (top-level min/max_pixels, as
    Qwen2VLVideoProcessor reads them); with none, the image processor's size in processor_config.json."""
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {
        "size": {"shortest_edge": 784, "longest_edge": 50176}, "patch_size": 14, "merge_size": 2}}))
    config = video_config(tmp_path, "qwen2_5_vl")
    assert config is not None and (config.min_pixels, config.max_pixels, config.fps) == (784, 50176, None)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    config = video_config(tmp_path, "qwen2_5_vl")
    assert config is not None and (config.min_pixels, config.max_pixels) == (3136, 12845056)
    onevision = tmp_path / "ov"
    onevision.mkdir()
    (onevision / "processor_config.json").write_text(json.dumps({"image_processor": {
        "size": {"height": 32, "width": 32}}}))
    assert video_config(onevision, "llava_onevision") == VideoConfig(
        sampler="uniform", temporal_patch=1, min_pixels=1024, max_pixels=1024, fps=None)


@pytest.mark.parametrize("bad", [{"fps": "fast"}, {"fps": 0}, {"num_frames": 0}, {"max_frames": 2.5},
                                 {"size": {"shortest_edge": 100, "longest_edge": 10}}])
def test_a_config_a_video_config_cannot_hold_is_refused(tmp_path: Path, bad: dict[str, Any]) -> None:
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": bad}))
    with pytest.raises(ValueError, match="video processor config"):
        video_config(tmp_path, "qwen2_vl")
