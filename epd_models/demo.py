"""Find the demo model: a tiny LLaVA trained on CPU to name the colour (and shape) of a synthetic shape.

Its weights are committed in `demo/` beside this file; the builders make them (`make demo-model`, which runs
`python -m epd_builders.demo_train train`). The product only finds them: it never trains.
"""
from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"
EVAL_SEED = 12345  # held out: training draws from seeds 0, 1, ...
BUILD_COMMAND = "make demo-model"


def has_model(model_dir: Path) -> bool:
    return (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()


def find_demo_model(model_dir: Path = DEMO_DIR) -> Path:
    """`model_dir` (the committed demo model), or FileNotFoundError naming the command that builds it."""
    if not has_model(model_dir):
        raise FileNotFoundError(f"the demo model's weights are missing from {model_dir}; build them with "
                                f"`{BUILD_COMMAND}` (python -m epd_builders.demo_train train, about two minutes on CPU)")
    return model_dir
