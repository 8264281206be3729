"""Longrope checkpoints (Phi-3's and Phi-4-multimodal's rotary scaling) are served within their short factors
(decoder_service/engine/memory_plan.py `checkpoint_max_len`): past original_max_position_embeddings transformers
switches a whole forward to the long factors and prefills again, and a packed step would switch every row at once.
So max_model_len defaults to original_max_position_embeddings, an explicit --max-model-len past it exits 2 naming
it before any weight loads, and a prompt past it is the usual 400; other rope types keep max_position_embeddings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import Phi4MultimodalConfig

from decoder_service.config import DecoderConfig
from decoder_service.engine.memory_plan import KVPlanError, checkpoint_max_len, plan_for
from decoder_service.preflight import check_kv_fits
from epd_builders.audio_tiny import AudioTinySpec, build_audio_tiny
from epd_common.startup import ConfigError
from epd_models.halves import LanguageHalf

ORIGINAL, LONG = 256, 8192


def longrope(half: int) -> dict[str, object]:
    """Factors per rotary pair (head_dim / 2), the long ones 4x."""
    return {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [4.0] * half,
            "factor": LONG / ORIGINAL}


def test_a_longrope_checkpoint_is_served_to_its_original_length() -> None:
    cfg = Phi4MultimodalConfig(rope_scaling=longrope(48), max_position_embeddings=LONG,
                               original_max_position_embeddings=ORIGINAL)
    assert checkpoint_max_len(cfg) == checkpoint_max_len(cfg, ORIGINAL) == ORIGINAL
    with pytest.raises(KVPlanError, match=f"past this checkpoint's longrope original_max_position_embeddings {ORIGINAL}"):
        checkpoint_max_len(cfg, ORIGINAL + 1)
    plain = Phi4MultimodalConfig(max_position_embeddings=LONG, original_max_position_embeddings=ORIGINAL)
    assert checkpoint_max_len(plain, LONG) == LONG  # no longrope: the whole max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = build_audio_tiny(AudioTinySpec(family="phi4_multimodal"), tmp_path_factory.mktemp("longrope") / "phi4")
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(max_position_embeddings=LONG, original_max_position_embeddings=ORIGINAL, rope_scaling=longrope(8))  # head_dim 16
    cfg.pop("rope_parameters", None)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_max_model_len_defaults_to_it_and_past_it_is_refused_before_loading(model_dir: Path) -> None:
    lm = LanguageHalf(model_dir)
    assert plan_for(DecoderConfig(kv_cache_memory=1 << 24), lm).max_model_len == ORIGINAL
    with pytest.raises(ConfigError, match=f"use --max-model-len {ORIGINAL} or less"):
        check_kv_fits(model_dir, dtype="auto", device="cpu", block_size=16, max_model_len=ORIGINAL + 16,
                      kv_cache_memory=0)
    check_kv_fits(model_dir, dtype="auto", device="cpu", block_size=16, max_model_len=ORIGINAL, kv_cache_memory=0)
