"""The "bench-lm" preset: bench's vision tower with a larger LM, cached under its own name; `bench` is unchanged.

Sizes are checked on the meta device; nothing is built here (a build takes about 15 s).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

import epd_builders.bench_model as bench_model
from epd_builders.bench_model import BENCH_LM_SPEC, BENCH_SPEC, BENCH_VIDEO_SPEC, bench_configs
from epd_builders.tokenizer import train_tokenizer
from epd_models.resolve import resolve_model


def test_bench_lm_has_benchs_vision_tower_and_a_larger_lm() -> None:
    tok = train_tokenizer("<image>", "<image>")
    lm_cfg, bench_cfg = bench_configs(BENCH_LM_SPEC, tok), bench_configs(BENCH_SPEC, tok)
    assert lm_cfg.vision_config.to_dict() == bench_cfg.vision_config.to_dict()
    assert replace(BENCH_LM_SPEC, text_hidden=256, text_intermediate=1024, text_layers=4, text_heads=4) == BENCH_SPEC
    t = lm_cfg.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (512, 8, 8, 2)
    with torch.device("meta"):
        lm = AutoModel.from_config(t)
    assert 20_000_000 < sum(p.numel() for p in lm.parameters()) < 30_000_000  # about 25M
    # a token's K/V: layers x (K, V) x kv heads x head dim x 4 bytes; small, so preallocated KV slots stay small
    assert t.num_hidden_layers * 2 * t.num_key_value_heads * (t.hidden_size // t.num_attention_heads) * 4 == 8192


@pytest.mark.parametrize("name,spec", [("bench-lm", BENCH_LM_SPEC), ("bench-video", BENCH_VIDEO_SPEC)])
def test_a_bench_variant_is_cached_apart_from_bench(name: str, spec: object, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[object] = []

    def fake_build(spec: object, out: Path) -> Path:
        built.append(spec)
        (out / "model.safetensors").write_bytes(b"w")
        return out

    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bench_model, "build_bench", fake_build)
    variant = resolve_model(name)
    assert variant == tmp_path / "models" / f"{name}-{spec.digest}" and built == [spec]  # type: ignore[attr-defined]
    assert resolve_model("bench") == tmp_path / "models" / f"bench-{BENCH_SPEC.digest}" and built[-1] == BENCH_SPEC
    assert resolve_model(name) == variant and len(built) == 2
