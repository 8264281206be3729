"""Checkpoint access: read only the tensors one half needs (single file or sharded safetensors)."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor key in the checkpoint to the file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: model_dir / f for k, f in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def load_filtered(
    module: nn.Module, model_dir: Path, rename: Callable[[str], str], keep: Callable[[str], bool],
    assign: bool = False,
) -> list[str]:
    """Load the kept (renamed) checkpoint tensors into module; others are never read from disk.

    `assign`: the tensors replace the module's (a module built with its parameters on meta)."""
    wanted: dict[Path, dict[str, str]] = {}  # file -> {disk key: module key}
    for key, path in checkpoint_files(model_dir).items():
        name = rename(key)
        if keep(name):
            wanted.setdefault(path, {})[key] = name
    state: dict[str, torch.Tensor] = {}
    for path, keys in wanted.items():
        with safe_open(str(path), framework="pt") as f:  # memory-mapped: skipped keys cost nothing
            for key, name in keys.items():
                state[name] = f.get_tensor(key)
    missing, unexpected = module.load_state_dict(state, strict=False, assign=assign)
    if unexpected:
        raise ValueError(f"checkpoint keys with no place in the {type(module).__name__}: {unexpected[:5]}")
    return missing
