"""The fused CPU elementwise work (decoder_service/engine/cpu_fusion.py), on with the packed linears: a gated SiLU MLP
as two matmuls with post-ops, a plain RMSNorm on torch's rms_norm; a module the fused form does not reproduce keeps
its forward."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from decoder_service.engine import cpu_fusion, cpu_linear
from decoder_service.engine.cpu_linear import PackedLinear, pack_linears
from tests.decoder_service.engine_run import make_engine

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN")


def _mlp(act: str = "silu") -> LlamaMLP:
    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=160, hidden_act=act))


def _norm(cls: type[nn.Module] = LlamaRMSNorm) -> nn.Module:
    norm = cls(64)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


class GemmaStyleRMSNorm(nn.Module):
    """Gemma's norm scales by 1 + weight: RMSNorm-shaped, but not what rms_norm computes."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(hidden)), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _fused(module: nn.Module) -> bool:
    return "forward" in vars(module)  # fuse_model sets the instance's own forward


def test_a_packed_silu_mlp_runs_fused_and_agrees_with_its_own_forward() -> None:
    mlp = _mlp()
    pack_linears(mlp)
    x = torch.randn(1, 7, 64)
    with torch.inference_mode():
        want = type(mlp).forward(mlp, x)
        assert cpu_fusion.fuse_model(mlp).startswith("1 gated MLPs") and _fused(mlp)
        got = mlp(x)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        assert mlp(torch.randn(0, 64)).shape == (0, 64)  # a step with no rows for it


def test_an_rms_norm_runs_on_torch_s_kernel_bit_for_bit() -> None:
    norm = _norm()
    x = torch.randn(5, 3, 64)
    with torch.inference_mode():
        want = norm(x)
        assert "1 RMSNorms" in cpu_fusion.fuse_model(norm) and _fused(norm)
        assert torch.equal(norm(x), want)


def test_what_the_fused_form_does_not_reproduce_keeps_its_own_forward() -> None:
    gelu = _mlp("gelu")
    pack_linears(gelu)
    plain = _mlp()  # not packed: F.linear, nothing to fuse into
    gemma = _norm(GemmaStyleRMSNorm)
    with torch.inference_mode():
        for module in (gelu, plain, gemma):
            assert cpu_fusion.fuse_model(module) == "0 gated MLPs fused into their matmuls, 0 RMSNorms on torch's rms_norm"
            assert not _fused(module)


def test_a_projection_wrapped_after_fusing_makes_the_mlp_run_its_own_forward() -> None:
    """A LoRA adapter wraps a projection after the engine fused the MLP: the adapter's delta must not be skipped."""
    mlp = _mlp()
    pack_linears(mlp)
    with torch.inference_mode():
        cpu_fusion.fuse_model(mlp)
        inner = mlp.up_proj

        class Doubled(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return 2 * inner(x)

        before = mlp(x := torch.randn(4, 64))
        mlp.up_proj = Doubled()
        assert torch.allclose(mlp(x), 2 * before, rtol=1e-5, atol=1e-6)


def test_a_hook_on_the_mlp_still_runs_after_fusing_and_the_probe_does_not_call_it() -> None:
    """Tensor parallelism all-reduces through a forward hook on the MLP (epd_models/tensor_parallel.py)."""
    mlp = _mlp()
    pack_linears(mlp)
    calls: list[Any] = []
    mlp.register_forward_hook(lambda m, args, out: calls.append(out.shape))
    with torch.inference_mode():
        cpu_fusion.fuse_model(mlp)
        assert calls == []
        mlp(torch.randn(2, 64))
    assert calls == [(2, 64)]


def test_the_engine_fuses_by_default_and_not_with_cpu_exact_linear(tiny_model_dirs: dict[str, Path]) -> None:
    for exact in (False, True):
        engine = make_engine(tiny_model_dirs["llava"], cpu_exact_linear=exact)
        try:
            layer = engine.lm.module.get_submodule("language_model.layers.0")
            assert isinstance(layer.mlp.gate_proj, PackedLinear) is not exact
            assert _fused(layer.mlp) is not exact and _fused(layer.input_layernorm) is not exact
        finally:
            engine.close()
