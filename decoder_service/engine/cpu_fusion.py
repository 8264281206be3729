"""The elementwise work between the CPU linears, fused: the default with the prepacked linears (cpu_linear.py).

A decode step of 64 rows on `bench-peer` spends about 61 % of its time in the prepacked linears and 14 % in the
elementwise work between them (RMSNorm 4.6 %, rotary 3.2 %, SiLU × up 5.7 %; docs/BENCHMARKS.md "Where a
64-in-flight level's time goes"); in a 2,048-token prefill step SiLU × up alone is 12 %, mostly the first touch
of two fresh 23 MiB activations per layer. vLLM's CPU build runs the same places as fused kernels
(`silu_and_mul`, `rms_norm`). Here:

- a gated SiLU MLP (`gate_proj`, `up_proj`, `down_proj`, all PackedLinear, `act_fn` SiLU) runs as two oneDNN
  matmuls with post-ops: the gate's with SiLU ("swish"), the up projection's multiplied by that ("mul"), so
  neither the SiLU nor the product makes a tensor of its own;
- an RMSNorm whose output equals `torch.nn.functional.rms_norm`'s (torch's one-pass kernel) runs as that.

Each module is probed before it is changed, on a few random rows through its own forward: a module whose result
the fused form does not reproduce (Gemma's 1 + weight norm, a GELU MLP, a LoRA or quantized projection) keeps its
forward. The MLP's fused form checks at every call that its projections are still PackedLinear (a LoRA adapter
may wrap them later) and otherwise runs the module's own forward. The norm is bit-equal to transformers'; the MLP
differs from it in the last bits (3e-7 on `bench-peer`'s shapes), as the packed linears do (`--cpu-exact-linear`
turns both off).
"""
from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from decoder_service.engine.cpu_linear import PackedLinear

_PROBE_ROWS = 3


def fuse_model(module: nn.Module) -> str:
    """Every gated SiLU MLP and plain RMSNorm under `module` on its fused CPU form; what was done, for the log."""
    mlps = norms = 0
    with torch.no_grad():
        for sub in module.modules():
            if (width := _packed_mlp(sub)) and _probe(sub, _fused_mlp, width, exact=False):
                sub.forward = types.MethodType(_fused_mlp, sub)
                mlps += 1
            elif (norm := _rms_norm_shape(sub)) is not None:
                fused = functools.partial(_fused_norm, eps=norm[0])
                if _probe(sub, fused, norm[1], exact=True):
                    sub.forward = types.MethodType(fused, sub)
                    norms += 1
    return f"{mlps} gated MLPs fused into their matmuls, {norms} RMSNorms on torch's rms_norm"


def _packed_mlp(m: nn.Module) -> int:
    """A gated SiLU MLP on bias-free PackedLinears: its input width; anything else: 0."""
    gate, up, down = (getattr(m, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    if not all(isinstance(p, PackedLinear) and p.bias is None for p in (gate, up, down)) \
            or not isinstance(getattr(m, "act_fn", None), (nn.SiLU, _hf_silu())):
        return 0
    assert isinstance(gate, PackedLinear)
    return gate.in_features


def _hf_silu() -> type:
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # an older transformers: nn.SiLU only
        return nn.SiLU
    return SiLUActivation


def _rms_norm_shape(m: nn.Module) -> tuple[float, int] | None:
    """An RMSNorm-shaped module's epsilon and width (a 1-d fp32 CPU weight and `variance_epsilon` or `eps`), else
    None."""
    if not type(m).__name__.endswith("RMSNorm"):
        return None
    weight, eps = getattr(m, "weight", None), getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float) \
            or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return eps, weight.shape[0]


def _probe(m: nn.Module, fused: Callable[[nn.Module, torch.Tensor], torch.Tensor], width: int, exact: bool) -> bool:
    """Whether `fused` gives what `m`'s own forward gives on random rows (bit for bit if `exact`). The forward is
    called directly: a tensor-parallel all-reduce hook on the module must not run for a probe."""
    x = torch.randn(_PROBE_ROWS, width, generator=torch.Generator().manual_seed(0))
    try:
        want, got = m.forward(x), fused(m, x)
    except (RuntimeError, TypeError, ValueError):
        return False
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        return False
    return torch.equal(want, got) if exact else torch.allclose(want, got, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


_linear = torch.ops.mkldnn._linear_pointwise


def _fused_mlp(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    if not (isinstance(gate, PackedLinear) and isinstance(up, PackedLinear) and isinstance(down, PackedLinear)):
        return type(self).forward(self, x)  # a projection was wrapped since (a LoRA adapter): the module's own form
    h = _linear(x, gate.packed, None, "swish", [], "")  # SiLU(x W_g) as the matmul's post-op
    h = _linear.binary(x, h, up.packed, None, "mul")  # (x W_u) * SiLU(x W_g), likewise
    return down(h)


def _fused_norm(self: nn.Module, x: torch.Tensor, eps: float) -> torch.Tensor:
    weight: torch.Tensor = self.weight  # type: ignore[assignment]
    return F.rms_norm(x, weight.shape, weight, eps)
