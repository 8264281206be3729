"""The committed demo model answers colour questions correctly through the split serving path."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from epd_builders.demo_train import answer, train
from epd_builders.shapes import draw_shape
from epd_builders.tokenizer import QUESTIONS
from epd_models.demo import BUILD_COMMAND, DEMO_DIR, find_demo_model, has_model
from epd_models.halves import LanguageHalf, VisionHalf


def _answer(color: str, shape: str, seed: int) -> str:
    vision, lm = VisionHalf(DEMO_DIR), LanguageHalf(DEMO_DIR)
    return answer(vision, lm, draw_shape(color, shape, random.Random(seed)), QUESTIONS["color"])


@pytest.mark.parametrize(("color", "shape"), [("red", "circle"), ("blue", "square"), ("yellow", "triangle")])
def test_demo_model_names_the_colour_via_split_path(color: str, shape: str) -> None:
    assert _answer(color, shape, seed=7) == color


def test_find_demo_model_returns_the_committed_dir() -> None:
    assert has_model(DEMO_DIR)
    assert find_demo_model() == DEMO_DIR


def test_find_demo_model_without_weights_names_the_build_command(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*`{BUILD_COMMAND}`"):
        find_demo_model(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))  # nothing was trained


def test_training_script_runs_and_saves_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    stats = train(out, steps=3)
    assert stats["steps"] == 3 and has_model(out)
    trained, committed = LanguageHalf(out).module.state_dict(), LanguageHalf(DEMO_DIR).module.state_dict()
    assert trained.keys() == committed.keys()
    assert VisionHalf(out).encode([draw_shape("red", "circle", random.Random(0))])[0].num_tokens == 64
