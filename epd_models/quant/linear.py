"""Linears whose weights stay quantized in memory (CUDA by default; `--quantized-weights keep` anywhere).

FP8 (`Fp8Linear`): activations are quantized per token at run time (the checkpoints' "dynamic" scheme), then
  - per-channel weights: `torch._scaled_mm` with row-wise scales (SM 8.9+);
  - block-wise weights (128 x 128): `torch.nn.functional.scaled_mm` with BlockWise1x128 activations and
    BlockWise128x128 weights (torch 2.13, SM 9.0);
  where the kernel refuses (shape, device), the weight block is dequantized into the activation dtype for that
  call: the bytes held stay FP8, the step is slower, and `kernel` says so (make gpu-check reports it).
int4 (`Int4Linear`): torch's tinygemm kernel (`_weight_int4pack_mm`, the one torchao's int4 weight-only layout
  runs on CUDA; `_weight_int4pack_mm_for_cpu` on the CPU), bf16 activations, scales and zeros per group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epd_models.quant.forms import Fp8Weight, Int4Weight

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FALLBACK = "dequantize_per_call"


def quantize_rows(x: torch.Tensor, block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (FP8 values, float32 scales): one scale per row, or per `block` columns of a row."""
    parts = x.float() if not block else x.float().unflatten(-1, (-1, block))
    amax = parts.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (parts / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q if not block else q.flatten(-2)), scale.squeeze(-1) if block else scale


class _Quantized(nn.Module):
    """`module.to(device, dtype)` moves the quantized buffers but never casts them (FP8 values, float32 scales,
    bf16 scales-and-zeros are what the kernels take); the bias follows the dtype like any parameter."""

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        device = fn(torch.empty(0)).device
        for name, buf in self._buffers.items():
            if buf is not None:
                self._buffers[name] = buf.to(device)
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias.data), requires_grad=False)
        return self


class Fp8Linear(_Quantized):
    weight_q: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, form: Fp8Weight, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight_q", form.q)
        self.register_buffer("weight_scale", form.scale.float())
        self.block = form.block
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = form.q.shape
        self.kernel = "unset"  # which path the first call took (gpu-check reports it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.kernel = fp8_mm(x.reshape(-1, self.in_features), self.weight_q, self.weight_scale, self.block,
                                scaled=self.kernel != FALLBACK)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def fp8_mm(flat: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
           scaled: bool = True) -> tuple[torch.Tensor, str]:
    """flat (M, K) @ W.T for the FP8 weight (q, scale, block), and the path taken (module docstring). `scaled`:
    False once the scaled kernel refused this weight (the caller remembers: no exception per step)."""
    if scaled and (flat.is_cuda or block[0] == 1):
        try:
            return _scaled(flat, q, scale, block), "scaled_mm" if block[0] == 1 else "scaled_mm_blockwise"
        except (RuntimeError, NotImplementedError):
            pass
    return F.linear(flat, Fp8Weight(q, scale, block).dequantize(flat.dtype)), FALLBACK


def _scaled(flat: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = block
    if rows == 1:  # per channel: row-wise scales on both sides
        xq, xs = quantize_rows(flat)
        return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.t(), out_dtype=flat.dtype)
    xq, xs = quantize_rows(flat, cols)  # (M, K / cols) scales
    return F.scaled_mm(xq, q.t(), xs, F.ScalingType.BlockWise1x128, scale.t(), F.ScalingType.BlockWise128x128,
                       output_dtype=flat.dtype)


class Int4Linear(_Quantized):
    weight_packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    INNER_K_TILES = 8  # tinygemm's tile for K >= 1024 (torchao's default); 2 on the CPU build

    def __init__(self, form: Int4Weight, bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        if not form.contiguous_groups:
            raise ValueError("int4 kernels need contiguous groups (GPTQ act-order g_idx): dequantize instead")
        self.out_features, self.in_features = form.q.shape
        self.group_size = form.group_size
        self.on_cpu = device.type == "cpu"
        q = form.q.to(device)
        if self.on_cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        else:
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, self.INNER_K_TILES)
        self.register_buffer("weight_packed", packed)
        # tinygemm: w = (q - 8) * scale + zero, so zero = (8 - z) * scale for w = (q - z) * scale
        sz = torch.stack([form.scale.t(), ((8 - form.zero) * form.scale).t()], dim=-1)
        self.register_buffer("scales_and_zeros", sz.to(device, torch.bfloat16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(device), requires_grad=False)
        self.kernel = "weight_int4pack_mm" + ("_for_cpu" if self.on_cpu else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu if self.on_cpu else torch.ops.aten._weight_int4pack_mm
        y = mm(flat, self.weight_packed, self.group_size, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def quant_linear(form: Fp8Weight | Int4Weight, bias: torch.Tensor | None, device: torch.device) -> nn.Module:
    if isinstance(form, Fp8Weight):
        return Fp8Linear(Fp8Weight(form.q.to(device), form.scale.to(device), form.block),
                         None if bias is None else bias.to(device))
    return Int4Linear(form, bias, device)
