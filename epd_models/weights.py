"""Checkpoint access: read only the tensors one half needs (single file or sharded safetensors)."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, MODEL_FOR_MULTIMODAL_LM_MAPPING


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
    assign: bool = False, transform: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> list[str]:
    """Load the kept (renamed) checkpoint tensors into module; others are never read from disk.

    `assign`: the tensors replace the module's (a module built with its parameters on meta). `transform`: edits
    the renamed tensors (and may swap modules) before they load: quantized linears (epd_models/quant)."""
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
    if transform is not None:
        transform(state)
    missing, unexpected = module.load_state_dict(state, strict=False, assign=assign)
    if unexpected:
        raise ValueError(f"checkpoint keys with no place in the {type(module).__name__}: {unexpected[:5]}")
    return missing


def tied_pairs(cfg: PretrainedConfig, language_model: nn.Module, rename: Callable[[str], str]) -> list[tuple[str, str]]:
    """The (target, source) parameters transformers ties when AutoModelForImageTextToText loads this checkpoint, as
    LM-half names: `PreTrainedModel.get_expanded_tied_weights_keys` gives each PreTrainedModel's own
    `_tied_weights_keys` only when its own config's `tie_word_embeddings` is true. So `lm_head` follows the
    top-level config's flag (after the config class's own forwarding of a legacy text_config flag, which only some
    families do), never the text config's alone; the text model's own ties (none in the families served) follow
    the text config."""
    pairs: list[tuple[str, str]] = []
    if getattr(cfg, "tie_word_embeddings", False):
        # the class transformers loads it as (the audio families are multimodal LMs, not image-text-to-text ones)
        mapping = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING if type(cfg) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING \
            else MODEL_FOR_MULTIMODAL_LM_MAPPING
        composite = mapping[type(cfg)]
        keys: dict[str, str] = getattr(composite, "_tied_weights_keys", None) or {}
        pairs += [(rename(t), rename(s)) for t, s in keys.items()]
    if isinstance(language_model, PreTrainedModel):
        inner = language_model.get_expanded_tied_weights_keys(all_submodels=True)
        pairs += [(f"language_model.{t}", f"language_model.{s}") for t, s in inner.items()]
    return pairs


def tie_loaded(module: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """Tie as `PreTrainedModel.tie_weights(missing_keys=...)` does after loading: a missing target takes the
    source, a missing source takes the target, two loaded and equal become one, two loaded and different stay apart
    (the config is wrong about the checkpoint), two missing stay missing (the caller reports them)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for target, source in pairs:
        if target not in params or source not in params:
            continue
        t, s = params[target], params[source]
        if t.is_meta and s.is_meta:
            continue
        if s.is_meta:
            target, source = source, target
        elif not t.is_meta and (t.shape != s.shape or not torch.equal(t, s)):
            continue
        parent, _, name = target.rpartition(".")
        setattr(module.get_submodule(parent), name, params[source])
        params[target] = params[source]
