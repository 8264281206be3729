"""The "bench" preset: ViT-B/16-sized vision tower and a small LM, built once into a cache dir and reused.

Sizes are checked on the meta device (no 86M-parameter allocation); the builder itself runs on a
narrow copy of the spec, which exercises the same code in about a second.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

import epd_builders.bench_model as bench_model
from epd_builders.bench_model import BENCH_SPEC, bench_configs, build_bench, ensure_bench_model, invisible_token_ids
from epd_builders.tokenizer import train_tokenizer
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.registry import adapter_for
from epd_models.resolve import resolve_model
from tests.factories import make_image


def _num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_vision_tower_is_vit_b16_and_the_lm_is_small() -> None:
    cfg = bench_configs(BENCH_SPEC, train_tokenizer("<image>", "<image>"))
    v, t = cfg.vision_config, cfg.text_config
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size) == (768, 12, 12, 3072)
    assert (v.image_size, v.patch_size) == (224, 16)
    assert (t.hidden_size, t.num_hidden_layers) == (256, 4)
    fixed = adapter_for(cfg).spec.fixed_tokens
    assert fixed is not None and fixed(cfg) == BENCH_SPEC.num_image_tokens == 196
    with torch.device("meta"):
        vision, lm = AutoModel.from_config(v), AutoModel.from_config(t)
    assert 85_000_000 < _num_params(vision) < 87_000_000  # ViT-B/16: about 86M
    assert _num_params(lm) < 5_000_000


def test_builder_output_loads_as_two_halves(tmp_path: Path) -> None:
    narrow = replace(BENCH_SPEC, vision_hidden=32, vision_intermediate=64, vision_layers=1, vision_heads=2,
                     text_hidden=32, text_intermediate=64, text_layers=1, text_heads=2, text_kv_heads=1)
    model_dir = build_bench(narrow, tmp_path / "m")
    (features,) = VisionHalf(model_dir).encode([make_image(300, 200)])
    assert tuple(features.embeds.shape) == (196, 32)  # patch 16 at 224: 14 x 14 tokens, CLS dropped
    lm = LanguageHalf(model_dir)
    assert lm.config.text_config.max_position_embeddings == 2048
    muted = invisible_token_ids(lm.tokenizer)
    head = lm.module.lm_head.weight
    assert lm.tokenizer.eos_token_id in muted and 0 < len(muted) < len(lm.tokenizer) // 2
    assert torch.all(head[muted] == 0) and torch.all(head.abs().sum(-1)[[i for i in range(len(head))
                                                                         if i not in set(muted)]] > 0)


def test_built_once_into_the_cache_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[Path] = []

    def fake_build(spec: object, out: Path) -> Path:
        builds.append(out)
        (out / "model.safetensors").write_bytes(b"weights")
        return out

    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bench_model, "build_bench", fake_build)
    first = resolve_model("bench")
    assert first == tmp_path / "models" / f"bench-{BENCH_SPEC.digest}"
    assert resolve_model("bench") == first and len(builds) == 1
    assert (first / "model.safetensors").read_bytes() == b"weights" and first.stat().st_mode & 0o777 == 0o755
    assert list(first.parent.iterdir()) == [first]  # the temp build dir was renamed, nothing left behind
    other = ensure_bench_model(replace(BENCH_SPEC, text_layers=2))
    assert other != first and len(builds) == 2  # a changed spec builds afresh


def test_a_failed_build_leaves_no_partial_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_build(spec: object, out: Path) -> Path:
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bench_model, "build_bench", broken_build)
    with pytest.raises(OSError, match="disk full"):
        ensure_bench_model()
    assert list((tmp_path / "models").iterdir()) == []
