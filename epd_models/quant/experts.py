"""Mixture-of-experts weights kept in FP8 (the experts of Qwen3-VL-MoE's FP8 releases, published one tensor per
expert with block scales): transformers' eager expert loop (`Qwen3VLMoeTextExperts.forward`: each expert hit by the
step's tokens runs its gate, up and down projections on those tokens, weighted by the router), with each
projection through linear.fp8_mm, so the bytes held stay FP8 (one per weight and a float32 scale per block)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from epd_models.quant.forms import Fp8Weight
from epd_models.quant.linear import FALLBACK, _Quantized, fp8_mm

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Fp8Experts(_Quantized):
    bias = None  # _Quantized moves buffers; experts have no bias

    def __init__(self, experts: list[dict[str, Fp8Weight]], act_fn: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device):
        super().__init__()
        self.num_experts, self.act_fn = len(experts), act_fn
        self.block = experts[0]["gate_proj"].block
        for proj in PROJECTIONS:
            self.register_buffer(f"{proj}_q", torch.stack([e[proj].q for e in experts]).to(device))
            self.register_buffer(f"{proj}_scale", torch.stack([e[proj].scale for e in experts]).float().to(device))
        self.kernel = "unset"

    def _mm(self, x: torch.Tensor, proj: str, expert: int) -> torch.Tensor:
        q, scale = getattr(self, f"{proj}_q")[expert], getattr(self, f"{proj}_scale")[expert]
        y, self.kernel = fp8_mm(x, q, scale, self.block, scaled=self.kernel != FALLBACK)
        return y

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit.view(-1).tolist():
            top_k_pos, token_idx = torch.where(mask[expert])
            x = hidden_states[token_idx]
            h = self.act_fn(self._mm(x, "gate_proj", expert)) * self._mm(x, "up_proj", expert)
            y = self._mm(h, "down_proj", expert) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, y.to(final.dtype))
        return final
