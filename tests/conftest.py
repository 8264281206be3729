"""Shared factories: tiny models are built once per session into a temp dir."""
from __future__ import annotations

from pathlib import Path

import pytest

from epd_builders.tiny import FAMILIES, TinySpec, build_tiny
from epd_models.processors import register_processors

register_processors()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> dir of a tiny random model (LM weights scaled so greedy output varies)."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny(TinySpec(family=f, lm_scale=3.0), root / f) for f in FAMILIES}
