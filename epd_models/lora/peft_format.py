"""An adapter in the PEFT format (`adapter_config.json` + `adapter_model.safetensors`), read and checked against the
language model it is for.

Everything an adapter can get wrong is refused here with a `LoRAError` naming it, before any weight is used: a rank
above --max-lora-rank, a tensor whose shape does not match the base linear, NaN or infinite weights, a
`target_modules` that names nothing in this model, a path outside the allowed folder, a file larger than any adapter
of that rank could be, pickle (`adapter_model.bin` is never loaded), and what this version does not apply (DoRA,
biases, `modules_to_save`, per-module ranks, the embeddings). An adapter's tensors are split by half: the decoder reads
the language model's (and counts the vision tower's and projector's, which the encoders read and check:
encoder_service/lora.py), an encoder the vision half's."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from epd_models.base import FamilyAdapter

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
HEADER_SLACK = 1 << 20  # a safetensors header's JSON beside the tensors' bytes
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[^.]+)?\.weight$")
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "modules_to_save": "modules_to_save",
                "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
                "layers_to_transform": "layers_to_transform", "fan_in_fan_out": "fan_in_fan_out"}


class LoRAError(ValueError):
    """An adapter that is refused, and why."""


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter, checked: per LM module name (as the decoder's module names it), (A, B x scale)."""

    name: str
    path: Path
    rank: int
    base_model_name: str | None
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # tensors of the other half's linears, read there (the vision tower's, for the decoder: the encoders apply
    # them; the language model's, for an encoder)
    other_half: int = 0


def linear_shapes(module: torch.nn.Module, prefixes: tuple[str, ...] = ("language_model.layers.",)
                  ) -> dict[str, tuple[int, int]]:
    """(in, out) features of every linear an adapter may target: the language model's layers' linears (or, with
    the vision half's `prefixes`, its tower's and projector's)."""
    out: dict[str, tuple[int, int]] = {}
    for name, m in module.named_modules():
        fin, fout = getattr(m, "in_features", None), getattr(m, "out_features", None)
        if name.startswith(prefixes) and isinstance(fin, int) and isinstance(fout, int) and not name.endswith(".base"):
            out[name] = (fin, fout)
    return out


def read_adapter(name: str, path: str | Path, *, family: FamilyAdapter, shapes: dict[str, tuple[int, int]],
                 max_rank: int, dtype: torch.dtype, root: Path | None = None,
                 base_model_name: str | None = None, vision: bool | None = False) -> LoRAWeights:
    """The adapter at `path`, checked against this half's linears `shapes` (linear_shapes); LoRAError if refused.
    `vision`: which half reads it: False the decoder (the LM's linears; the vision tower's tensors are counted in
    `other_half`, for the encoders), True an encoder (the vision half's linears; the LM's counted), None the
    decoder where no encoder will apply vision-tower tensors (aggregated mode: they are refused)."""
    where = Path(path).expanduser()
    real = where.resolve()
    if root is not None and not real.is_relative_to(root.expanduser().resolve()):
        raise LoRAError(f"adapter {name!r}: {where} is outside the allowed folder {root}")
    if not real.is_dir():
        raise LoRAError(f"adapter {name!r}: {where} is not a folder with {CONFIG} and {WEIGHTS}")
    cfg = _config(name, real)
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"adapter {name!r}: {CONFIG} needs a positive integer r, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"adapter {name!r}: lora_alpha must be a finite number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    file = real / WEIGHTS
    if not file.is_file():
        bin_hint = " (adapter_model.bin is pickle: never loaded; convert it to safetensors)" \
            if (real / "adapter_model.bin").exists() else ""
        raise LoRAError(f"adapter {name!r}: no {WEIGHTS} in {where}{bin_hint}")
    limit = sum(max_rank * (i + o) for i, o in shapes.values()) * 8 + HEADER_SLACK  # fp64 at the largest rank
    if file.stat().st_size > limit:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS} is {file.stat().st_size} bytes, more than an adapter of rank "
                        f"<= {max_rank} for this model can be ({limit})")
    weights, other = _weights(name, file, family, shapes, rank, scale, dtype, vision)
    base = base_model_name or cfg.get("base_model_name_or_path")
    return LoRAWeights(name, where, rank, base if isinstance(base, str) else None, weights, other)


def _config(name: str, folder: Path) -> dict[str, Any]:
    file = folder / CONFIG
    if not file.is_file() or file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoRAError(f"adapter {name!r}: no {CONFIG} (or one over {MAX_CONFIG_BYTES} bytes) in {folder}")
    try:
        cfg = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"adapter {name!r}: {CONFIG} is not JSON: {exc}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {name!r}: {CONFIG} is not a LoRA adapter's (peft_type LORA)")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise LoRAError(f"adapter {name!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r}: bias {cfg['bias']!r} is not supported (only 'none')")
    return cfg


def _weights(name: str, file: Path, family: FamilyAdapter, shapes: dict[str, tuple[int, int]], rank: int,
             scale: float, dtype: torch.dtype, vision: bool | None
             ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    other = 0
    try:
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _KEY.match(key)
                if m is None:
                    raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a LoRA linear's A or B")
                module = family.normalize_key(m["module"] + ".weight").removesuffix(".weight")
                if module not in shapes and vision is not None and \
                        family.is_vision_key(module + ".weight") != vision and _layer_linear(module):
                    other += 1  # the other half's: read and checked there
                    continue
                if module not in shapes:
                    where = "vision tower (applied by encoders, from --lora-modules at start)" if vision is None else \
                        "vision half" if vision else "language model layers"
                    raise LoRAError(f"adapter {name!r}: tensor {key!r} targets {module!r}, not a linear of this "
                                    f"model's {where} (the embeddings are not applied)")
                halves.setdefault(module, {})[m["half"]] = f.get_tensor(key)
    except SafetensorError as exc:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS} is not a readable safetensors file: {exc}") from None
    if not halves and not other:
        raise LoRAError(f"adapter {name!r}: target_modules names nothing in this model (no LoRA tensors)")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(halves.items()):
        fin, fout = shapes[module]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise LoRAError(f"adapter {name!r}: {module} has lora_{'B' if b is None else 'A'} but not the other")
        if tuple(a.shape) != (rank, fin) or tuple(b.shape) != (fout, rank):
            raise LoRAError(f"adapter {name!r}: {module}'s A {tuple(a.shape)} and B {tuple(b.shape)} do not match "
                            f"the base linear ({fin} in, {fout} out) at rank {rank}: (r, in) and (out, r)")
        if not (a.is_floating_point() and b.is_floating_point()) or not (a.isfinite().all() and b.isfinite().all()):
            raise LoRAError(f"adapter {name!r}: {module} has weights that are not finite floats (NaN or inf)")
        out[module] = (a.to(dtype).contiguous(), (b.double() * scale).to(dtype).contiguous())
    return out, other


def _layer_linear(module: str) -> bool:
    """A name that may be another half's linear (not the embeddings or the head, which no half applies)."""
    return not module.endswith(("embed_tokens", "lm_head", "embed_positions", "patch_embedding"))
