"""Random checkpoints of the real LLaVA-1.5-7B and Qwen2.5-VL-3B shapes (epd_builders/full_size.py).

Full sizes are checked on the meta device (nothing allocated); the builder itself runs at `--size small`, which
takes the same code path in about a second.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText, LlamaConfig, LlavaConfig
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLVisionConfig

from epd_bench import family_bytes
from epd_builders.full_size import (
    LLAVA_7B,
    PRESETS,
    QWEN25_VL_3B,
    build_full_size,
    config_and_processor,
    ensure_full_size,
    full_size_dir,
    preset,
)
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.meta import params_on_meta
from tests.factories import make_image


def test_llava_sizes_are_the_transformers_defaults_the_docstring_names() -> None:
    clip, llama = LlavaConfig().vision_config, LlamaConfig()
    assert (LLAVA_7B.vision_hidden, LLAVA_7B.vision_intermediate, LLAVA_7B.vision_layers, LLAVA_7B.vision_heads,
            LLAVA_7B.image_size, LLAVA_7B.patch) == (clip.hidden_size, clip.intermediate_size,
                                                     clip.num_hidden_layers, clip.num_attention_heads,
                                                     clip.image_size, clip.patch_size)
    assert (LLAVA_7B.text_hidden, LLAVA_7B.text_intermediate, LLAVA_7B.text_layers, LLAVA_7B.text_heads) == (
        llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers, llama.num_attention_heads)
    cfg = config_and_processor(LLAVA_7B)[0]
    assert cfg.vision_feature_layer == LlavaConfig().vision_feature_layer and cfg.projector_hidden_act == "gelu"
    # and the same checkpoint as family_bytes (README's connector bytes) describes it
    assert {k: getattr(cfg.vision_config, k) for k in family_bytes.CLIP_L_336 if k not in ("model_type",
                                                                                          "projection_dim")} == {
        k: v for k, v in family_bytes.CLIP_L_336.items() if k not in ("model_type", "projection_dim")}
    assert all(getattr(cfg.text_config, k) == v for k, v in family_bytes.LLAMA_7B.items() if k != "model_type")


def test_qwen_sizes_are_the_transformers_defaults_the_docstring_names() -> None:
    vision = Qwen2_5_VLVisionConfig()
    assert (QWEN25_VL_3B.vision_layers, QWEN25_VL_3B.vision_intermediate, QWEN25_VL_3B.vision_heads,
            QWEN25_VL_3B.patch, QWEN25_VL_3B.window_size, QWEN25_VL_3B.fullatt_block_indexes) == (
        vision.depth, vision.intermediate_size, vision.num_heads, vision.patch_size, vision.window_size,
        tuple(vision.fullatt_block_indexes))
    assert QWEN25_VL_3B.rope_theta == Qwen2_5_VLTextConfig.default_theta
    cfg = config_and_processor(QWEN25_VL_3B)[0]
    head_dim = cfg.text_config.hidden_size // cfg.text_config.num_attention_heads
    assert sum(cfg.text_config.rope_parameters["mrope_section"]) == head_dim // 2
    assert cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size
    real = family_bytes.REAL["qwen2_5_vl"].config().vision_config  # the 7B's tower is the 3B's
    assert (cfg.vision_config.hidden_size, cfg.vision_config.depth) == (real.hidden_size, real.depth)


@pytest.mark.parametrize(("name", "published_billions"), [("llava-1.5-7b", 7.06), ("qwen2.5-vl-3b", 3.75)])
def test_full_presets_have_the_parameter_counts_the_hub_publishes(name: str, published_billions: float) -> None:
    cfg = config_and_processor(preset(name))[0]
    with params_on_meta():
        model = AutoModelForImageTextToText.from_config(cfg)
    model.tie_weights()
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == published_billions


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_small_checkpoint_serves_from_both_halves_with_the_real_vocabulary(name: str, tmp_path: Path) -> None:
    spec = preset(name, "small")
    out = build_full_size(spec, tmp_path / name)
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == PRESETS[name].vocab_size and config["dtype"] == "float32"
    lm = LanguageHalf(out)
    head = lm.module.lm_head.weight
    assert head.shape == (PRESETS[name].vocab_size, spec.text_hidden)
    assert not head[len(lm.tokenizer):].any() and head[: len(lm.tokenizer)].any()  # ids no tokenizer entry decodes
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        stored_head = any(k.endswith("lm_head.weight") for k in f.keys())
    tied = head is lm.module.language_model.embed_tokens.weight
    assert (tied, stored_head) == ((True, False) if spec.tie_word_embeddings else (False, True))
    image = make_image(224, 224)
    features = VisionHalf(out).encode([image])[0]
    grid = spec.image_size // spec.patch if spec.family == "llava" else 224 // (spec.patch * 2)
    assert features.embeds.shape == (grid * grid, spec.text_hidden)
    assert torch.isfinite(features.embeds).all()


def test_the_cache_reuses_a_build_and_drops_stale_builds_of_the_same_preset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    target = full_size_dir("llava-1.5-7b", "small")
    models = target.parent
    stale, other_size = models / "llava-1.5-7b-small-0123456789ab", models / "llava-1.5-7b-0123456789ab"
    for d in (stale, other_size):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"old")
    first = ensure_full_size("llava-1.5-7b", "small")
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert first == target and ensure_full_size("llava-1.5-7b", "small") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written  # not rebuilt
    assert not stale.exists() and other_size.exists()  # only the same preset and size is replaced
