"""The "bench-video" preset: a Qwen2-VL with a heavy vision tower and a small LM, cached under its own name.

Sizes are checked on the meta device; the builder runs on a narrow copy of the spec (about a second), which
exercises the same code: the video processor config it writes is what a worker reports and plans with, a 224x224
frame stays 16x16 patches, and the chat template writes Qwen's video markup for a video part.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from epd_bench.video_clip import make_clip
from epd_builders.bench_model import (
    BENCH_VIDEO_SPEC,
    build_bench,
    invisible_token_ids,
)
from epd_builders.families import qwen
from epd_common.video import VideoLimits
from epd_common.video_decode import decode_frames
from epd_common.video_sampling import VideoConfig
from epd_models.chat import render
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.video_config import video_config


def test_a_vit_b_wide_vision_tower_six_blocks_deep_and_benchs_small_lm() -> None:
    cfg = qwen.build(BENCH_VIDEO_SPEC.tiny_spec()).config
    v, t = cfg.vision_config, cfg.text_config
    assert cfg.model_type == "qwen2_vl" and (v.embed_dim, v.depth, v.mlp_ratio, v.patch_size) == (768, 6, 4, 14)
    assert (v.temporal_patch_size, v.spatial_merge_size, t.hidden_size, t.num_hidden_layers) == (2, 2, 256, 4)
    with torch.device("meta"):
        vision, lm = Qwen2VisionTransformerPretrainedModel._from_config(v), AutoModel.from_config(t)
    assert 50_000_000 < sum(p.numel() for p in vision.parameters()) < 57_000_000  # about 54M, the merger included
    assert sum(p.numel() for p in lm.parameters()) < 5_000_000


@pytest.fixture(scope="module")
def narrow_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    narrow = replace(BENCH_VIDEO_SPEC, vision_hidden=32, vision_layers=1, text_hidden=32, text_layers=1, heads=2,
                     kv_heads=1)
    return build_bench(narrow, tmp_path_factory.mktemp("bench-video") / "m")


def test_the_video_config_workers_report_keeps_a_224_frame_whole(narrow_dir: Path) -> None:
    assert video_config(narrow_dir, "qwen2_vl") == VideoConfig(sampler="qwen2", temporal_patch=2, min_pixels=784,
                                                               max_pixels=224 * 224, fps=2.0,
                                                               patch_size=14, merge_size=2)
    frames = decode_frames(make_clip(0, 1, 4, 224, 224, 2.0), range(4), VideoLimits())
    features = VisionHalf(narrow_dir).encode_video(frames, 2.0)
    assert tuple(features.embeds.shape) == (2 * 16 * 16 // 4, 32)  # 2 temporal patches of 16x16, merged 2x2


def test_a_video_part_renders_as_qwens_video_markup_and_invisible_tokens_are_muted(narrow_dir: Path) -> None:
    lm = LanguageHalf(narrow_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "hi"}]}]
    text = lm.tokenizer.decode(render(lm.tokenizer, messages, lm.tokenizer.chat_template))
    assert f"{qwen.QWEN_IMAGE_MARKUP}<|vision_start|><|video_pad|><|vision_end|>hi" in text
    muted = invisible_token_ids(lm.tokenizer)
    assert lm.tokenizer.eos_token_id in muted and torch.all(lm.module.lm_head.weight[muted] == 0)
