"""Quantized tensors in a checkpoint: where they are (the linears' prefixes), the check before any weight loads,
and the loader's step that turns one half's raw tensors into what its modules hold.

A linear is quantized when the checkpoint has its format's tensors (readers.TENSORS; for FP8, also a `weight` of
dtype float8 with no scale beside it, which is refused); every other tensor loads as it is, in the checkpoint's
dtype (vision towers, `lm_head`, embeddings, norms: what `modules_to_not_convert` / `ignore` name)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from epd_models.quant.forms import Form
from epd_models.quant.readers import MARKERS, TENSORS, check, read
from epd_models.quant.scheme import QuantError, QuantScheme, check_flag, read_scheme

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F32": torch.float32,
                       "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32, "I64": torch.int64,
                       "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "BOOL": torch.bool,
                       "F64": torch.float64}


def quantized_prefixes(scheme: QuantScheme | None, dtypes: dict[str, torch.dtype]) -> list[str]:
    """The prefixes of the quantized linears among `dtypes`' keys (key -> dtype), in key order."""
    found: dict[str, None] = {}
    suffixes = set(TENSORS[scheme.kind]) - {"weight"} if scheme else set()
    for key, dtype in dtypes.items():
        prefix, _, suffix = key.rpartition(".")
        if suffix in suffixes or (suffix == "weight" and dtype in FP8):
            found[prefix] = None
    return list(found)


class DictSource:
    """readers.Source over tensors already read (the loader's state dict)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        t = self.state.get(name)
        return None if t is None else (tuple(t.shape), t.dtype)

    def value(self, name: str) -> torch.Tensor:
        return self.state[name]


class FileSource:
    """readers.Source over a checkpoint's safetensors files: headers for shapes, tensors read only when asked."""

    def __init__(self, files: dict[str, Path], stack: contextlib.ExitStack):
        self.files, self.stack = files, stack
        self.open: dict[Path, Any] = {}

    def _handle(self, name: str):  # noqa: ANN202 - safetensors' handle type is private
        path = self.files[name]
        if path not in self.open:
            self.open[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        return self.open[path]

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        if name not in self.files:
            return None
        part = self._handle(name).get_slice(name)
        return tuple(part.get_shape()), _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.uint8)

    def value(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


def check_checkpoint(model_dir: str | Path, flag: str | None = None) -> QuantScheme | None:
    """Before any weight loads: the scheme, `--quantization` against it, and every quantized linear's tensors
    (headers, and the scales' values). QuantError names what is wrong."""
    from epd_models.weights import checkpoint_files

    scheme = read_scheme(model_dir)
    check_flag(scheme, flag)
    files = checkpoint_files(Path(model_dir))
    with contextlib.ExitStack() as stack:
        src = FileSource(files, stack)
        dtypes = {key: meta[1] for key in files if (meta := src.meta(key)) is not None}
        prefixes = quantized_prefixes(scheme, dtypes)
        if scheme is None:
            if prefixes:
                raise QuantError(f"tensor {prefixes[0]}.weight is FP8 but config.json has no quantization_config")
            return None
        for prefix in prefixes:
            check(scheme, prefix, src)
        if not prefixes:
            raise QuantError(f"config.json says {scheme.label} but no tensor is quantized (looked for "
                             f"*.{MARKERS[scheme.kind]})")
    return scheme


def take_quantized(state: dict[str, torch.Tensor], scheme: QuantScheme | None) -> dict[str, Form]:
    """Remove every quantized linear's tensors from `state` (module names); return their forms by prefix."""
    prefixes = quantized_prefixes(scheme, {k: t.dtype for k, t in state.items()})
    if not prefixes:
        return {}
    if scheme is None:
        raise QuantError(f"tensor {prefixes[0]}.weight is FP8 but config.json has no quantization_config")
    src = DictSource(state)
    forms = {prefix: read(scheme, prefix, src) for prefix in prefixes}
    for prefix in prefixes:
        for suffix in TENSORS[scheme.kind]:
            state.pop(f"{prefix}.{suffix}", None)
    return forms


def dequantize_into(state: dict[str, torch.Tensor], forms: dict[str, Form], dtype: torch.dtype,
                    expected: Callable[[str], tuple[int, ...] | None]) -> None:
    """Each form's dequantized weight into `state` as `<prefix>.weight` in `dtype`, checked against the module's
    shape (`expected`: the module's shape for a name, None where it has no such parameter)."""
    for prefix, form in forms.items():
        want = expected(f"{prefix}.weight")
        if want is not None and tuple(want) != tuple(form.shape):
            raise QuantError(f"tensor {prefix}: quantized weight is {list(form.shape)}, the model's "
                             f"{prefix}.weight is {list(want)}")
        state[f"{prefix}.weight"] = form.dequantize(dtype)


def held_bytes(forms: Iterable[Form]) -> int:
    return sum(f.held_bytes for f in forms)
