"""One half's quantized linears at load time: dequantized once into the compute dtype (the CPU default: exact
against the dequantized twin), or kept quantized and run through quantized kernels (linear.py; the CUDA default).
Experts published one tensor per expert are dequantized and fused into the model's expert parameters either way
(no fused FP8 expert kernel is in torch 2.13: the bytes they hold are counted as such)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from epd_models.experts import PER_EXPERT, fuse_experts
from epd_models.quant.experts import PROJECTIONS, Fp8Experts
from epd_models.quant.forms import Form, Fp8Weight
from epd_models.quant.linear import quant_linear
from epd_models.quant.load import dequantize_into, take_quantized
from epd_models.quant.scheme import QuantError, QuantScheme

MODES = ("auto", "dequantize", "keep")


@dataclass
class QuantLoad:
    """The transform `load_filtered` calls for one half, and what it did (for the log and /health)."""

    scheme: QuantScheme | None
    dtype: torch.dtype
    device: torch.device
    mode: str = "auto"  # auto: keep on CUDA, dequantize elsewhere
    split: Any = None  # tensor parallelism: this rank's cut (epd_models/tensor_parallel.py Split), applied on reading
    kept: int = 0
    dequantized_whole: int = 0  # tensor parallelism: forms dequantized before their cut (it splits a block or group)
    dequantized: int = 0
    kernels: set[str] = field(default_factory=set)

    @property
    def keeps(self) -> bool:
        return self.mode == "keep" or (self.mode == "auto" and self.device.type == "cuda")

    def __call__(self, module: nn.Module) -> Any:
        def transform(state: dict[str, torch.Tensor]) -> None:
            forms = take_quantized(state, self.scheme)
            if self.split is not None:
                forms = self._cut(state, forms)
            params = {name: p.shape for name, p in module.named_parameters()}
            kept = self._keep_experts(module, forms) if self.keeps else set()
            for prefix, form in forms.items():
                if self.keeps and prefix not in kept and not PER_EXPERT.fullmatch(f"{prefix}.weight") and \
                        self._swap(module, prefix, form, state.get(f"{prefix}.bias")):
                    state.pop(f"{prefix}.bias", None)
                    kept.add(prefix)
            rest = {p: f for p, f in forms.items() if p not in kept}
            dequantize_into(state, rest, self.dtype, params.get)
            fuse_experts(state, params)
            self.kept, self.dequantized = len(kept), len(rest) + self.dequantized_whole
        return transform

    def _cut(self, state: dict[str, torch.Tensor], forms: dict[str, Form]) -> dict[str, Form]:
        """This rank's share of every form and tensor. A form whose cut would split a block or group is refused when
        it would be kept; when it is dequantized anyway, it is dequantized whole and cut as a tensor."""
        cut: dict[str, Form] = {}
        for prefix, form in forms.items():
            try:
                cut[prefix] = self.split.form(prefix, form)
            except ValueError:
                if self.keeps:
                    raise
                state[f"{prefix}.weight"] = form.dequantize(self.dtype)
                self.dequantized_whole += 1
        for name in list(state):
            state[name] = self.split.tensor(name, state[name])
        return cut

    def _keep_experts(self, module: nn.Module, forms: dict[str, Form]) -> set[str]:
        """FP8 experts published one tensor per expert -> one Fp8Experts module per layer; the prefixes it took."""
        layers: dict[str, dict[int, dict[str, Fp8Weight]]] = {}
        for prefix, form in forms.items():
            m = PER_EXPERT.fullmatch(f"{prefix}.weight")
            if m and isinstance(form, Fp8Weight):
                layers.setdefault(m["base"], {}).setdefault(int(m["e"]), {})[m["proj"]] = form
        taken: set[str] = set()
        for base, experts in layers.items():
            ordered = [experts.get(e, {}) for e in range(len(experts))]
            if any(set(e) != set(PROJECTIONS) for e in ordered):
                continue  # incomplete: fuse_experts names what is missing
            parent, _, name = base.rpartition(".")
            act_fn: Callable[[torch.Tensor], torch.Tensor] = module.get_submodule(base).act_fn  # type: ignore[assignment]
            new = Fp8Experts(ordered, act_fn, self.device)
            setattr(module.get_submodule(parent), name, new)
            taken |= {f"{base}.{e}.{p}" for e in range(len(ordered)) for p in PROJECTIONS}
            self.kernels.add("fp8_experts")
        return taken

    def _swap(self, module: nn.Module, prefix: str, form: Form, bias: torch.Tensor | None) -> bool:
        """Replace the linear at `prefix` by its quantized kernel module; False where the kernel cannot take this
        weight (GPTQ act-order groups, a shape tinygemm refuses): that linear is dequantized instead."""
        parent, _, name = prefix.rpartition(".")
        old = module.get_submodule(prefix)
        if not isinstance(old, nn.Linear) or tuple(old.weight.shape) != tuple(form.shape):
            raise QuantError(f"tensor {prefix}: quantized weight {list(form.shape)} has no linear of that shape "
                             f"in the model ({type(old).__name__})")
        try:
            new = quant_linear(form, None if bias is None else bias.to(self.dtype), self.device)
        except (ValueError, RuntimeError):
            return False
        self.kernels.add(getattr(new, "kernel", type(new).__name__))
        setattr(module.get_submodule(parent) if parent else module, name, new)
        return True

    def summary(self) -> dict[str, Any] | None:
        """What /health reports as model_identity["quantization"] (None: an unquantized checkpoint)."""
        if self.scheme is None:
            return None
        how = "kept quantized" if self.kept and not self.dequantized else (
            f"dequantized to {str(self.dtype).removeprefix('torch.')} at load" if not self.kept else "mixed")
        return {"method": self.scheme.method, "format": self.scheme.label, "weights": how,
                "quantized_linears": self.kept + self.dequantized, "kept": self.kept,
                "dequantized": self.dequantized}
