"""The demo model: a tiny LLaVA trained on CPU to name the colour (and shape) of a synthetic shape.

Its weights are committed in `demo/` beside this file; `python -m epd_builders.demo_train train` made them.
"""
from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"
EVAL_SEED = 12345  # held out: training draws from seeds 0, 1, ...


def has_model(model_dir: Path) -> bool:
    return (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()


def ensure_demo_model() -> Path:
    """DEMO_DIR, training it first (about two minutes on 2 CPU cores) if the weights are absent."""
    if not has_model(DEMO_DIR):
        from epd_builders.demo_train import DEMO_STEPS, train  # only a checkout without the weights gets here

        train(DEMO_DIR, DEMO_STEPS)
    return DEMO_DIR
