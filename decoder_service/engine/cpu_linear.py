"""CPU decode steps through oneDNN's prepacked matmul (`--cpu-packed-linear`, off by default).

MKL's sgemm, what `F.linear` calls on this CPU, costs a small batch of rows about as much as that many single rows
(1024 x 2816 fp32, 2 cores: 0.26 ms for 1 row, 1.09 ms for 4, 1.37 ms for 16), which is most of a decode step.
oneDNN with the weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`, what vLLM's CPU build relies on)
took 0.16 / 0.29 / 0.72 ms, but is slower for prefill-sized inputs (10.1 against 8.7 ms at 256 rows). So a
linear with at most `PACKED_MAX_ROWS` input rows goes through the packed weight, larger ones through `F.linear`
(`python -m epd_bench.paged_attention` does not cover it; the ratios are in docs/BENCHMARKS.md).

The numbers differ from `F.linear`'s in the last bits (5e-6 relative), so greedy tokens may differ from
transformers' `generate()` where two logits are that close: off by default, and the parity tests run without it.
It keeps the original weight for the large inputs: the LM's linear weights are held twice.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PACKED_MAX_ROWS = 64


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= PACKED_MAX_ROWS and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.linear.bias, "none", [], "")
        return F.linear(x, self.linear.weight, self.linear.bias)


def pack_linears(module: nn.Module) -> int:
    """Every float32 nn.Linear under `module` (on the CPU) wrapped in a PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
            setattr(module, name, PackedLinear(child))
            count += 1
        elif not isinstance(child, PackedLinear):
            count += pack_linears(child)
    return count


def available() -> bool:
    ops: Any = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
