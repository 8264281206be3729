"""One rank's share of a language model split over N ranks (tensor parallelism, vLLM's split).

Column-parallel: q/k/v projections and the MLP's gate/up projections (a dense MLP, a shared expert, and each routed
expert's width in the fused `experts.gate_up_proj`) keep rows [r*out/N, (r+1)*out/N) of their weight (and bias).
Row-parallel: the attention's o_proj and the MLP's down_proj (and `experts.down_proj`) keep the matching input
columns; their partial outputs are summed across ranks by one all-reduce after each layer's attention and after its
MLP block (a forward hook on `self_attn` and on `mlp`), so every rank holds the whole hidden state between blocks.
A row-parallel bias is added by rank 0 alone. Embeddings, norms, the MoE router, lm_head and everything outside the
decoder layers are replicated. Each rank's attention sees heads/N query heads and kv_heads/N K/V heads: transformers'
attention modules reshape with -1 heads, so the module classes run unchanged on the narrower weights.

`shard(module, rank, size)` makes the module's split parameters the local shapes (on meta, before loading) and
returns the `Split` that cuts each checkpoint tensor, and each quantized linear's form (FP8 values and block scales,
int4 values with their groups' scales and zeros), to this rank's share as it loads: a kept-quantized linear stays
quantized on every rank, a cut that would fall inside an FP8 block or an int4 group is refused (one that is
dequantized anyway is dequantized whole first, then cut). `check_split` refuses a model whose heads, K/V heads or MLP widths do not divide by N, with the
numbers (vLLM replicates K/V heads when N exceeds them; EPD refuses). The process group is torch.distributed's
default group, set up by the decoder (decoder_service/engine/tp); `local_forward()` turns the all-reduces off for a
forward one rank runs alone (the CUDA memory profile).
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from epd_models.quant.forms import Form, Fp8Weight, Int4Weight

# (pattern of a language-model key, dimension cut, row-parallel): matched against the half's module keys
_LAYER = r"language_model\.layers\.\d+\."
RULES: tuple[tuple[re.Pattern[str], int, bool], ...] = (
    (re.compile(_LAYER + r"self_attn\.[qkv]_proj\.(weight|bias)"), 0, False),
    (re.compile(_LAYER + r"mlp\.(.+\.)?(gate|up)_proj\.(weight|bias)"), 0, False),
    (re.compile(_LAYER + r"self_attn\.o_proj\.weight"), 1, True),
    (re.compile(_LAYER + r"mlp\.(.+\.)?down_proj\.weight"), 1, True),
    (re.compile(_LAYER + r"mlp\.experts\.gate_up_proj"), 1, False),  # (experts, 2 x width, hidden): each half cut
    (re.compile(_LAYER + r"mlp\.experts\.down_proj"), 2, True),  # (experts, hidden, width)
)
_ROW_BIAS = re.compile(_LAYER + r"(self_attn\.o_proj|mlp\.(.+\.)?down_proj)\.bias")
_FUSED = re.compile(_LAYER + r"(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")  # fused linears: not split here


class SplitError(ValueError):
    """The model cannot be split over this many ranks (the message has the numbers)."""


@dataclass
class CommClock:
    """Seconds this rank spent in the forward's all-reduces (the benchmark's communication time per step)."""

    seconds: float = 0.0
    calls: int = 0


CLOCK = CommClock()
_local = threading.local()


def check_split(text_config: Any, size: int) -> None:
    """SplitError unless every dimension the split cuts divides by `size`."""
    if size == 1:
        return
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    widths = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(text_config, name, None):
            widths[name] = int(getattr(text_config, name))
    bad = [f"{name} {value}" for name, value in widths.items() if value % size]
    if bad:
        raise SplitError(f"--tensor-parallel-size {size} does not divide the model's {', '.join(bad)} (each rank "
                         f"holds 1/{size} of them); K/V heads are not replicated across ranks: use a size that "
                         f"divides {kv_heads} K/V heads and {heads} heads")


def _rule(name: str) -> tuple[int, bool] | None:
    for pattern, dim, row in RULES:
        if pattern.fullmatch(name):
            return dim, row
    return None


def cut(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's share of the module tensor `name` (the tensor itself when it is replicated)."""
    rule = _rule(name)
    if rule is None:
        if _ROW_BIAS.fullmatch(name) and rank != 0:
            return torch.zeros_like(tensor)  # the sum over ranks adds it once
        return tensor
    dim, _ = rule
    if name.endswith("experts.gate_up_proj"):  # gate rows then up rows: each half cut alike, kept in that order
        gate, up = tensor.chunk(2, dim=dim)
        return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim).contiguous()
    if tensor.shape[dim] % size:
        raise SplitError(f"{name}: dimension {dim} of {tuple(tensor.shape)} does not divide by {size}")
    return tensor.chunk(size, dim=dim)[rank].contiguous()


@dataclass(frozen=True)
class Split:
    """This rank's cut of each checkpoint tensor and quantized form as it loads (QuantLoad applies it right after it
    reads the forms, before anything is dequantized, kept or fused)."""

    rank: int
    size: int

    def tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return cut(name, tensor, self.rank, self.size)

    def form(self, prefix: str, form: Form) -> Form:
        """A quantized linear's share: its values and the scales (zeros, groups) of its blocks or groups; SplitError
        where the cut would fall inside an FP8 block or an int4 group."""
        rule = _rule(f"{prefix}.weight")
        if rule is None:
            return form
        dim, _ = rule
        full = form.shape[dim]
        if full % self.size:
            raise SplitError(f"{prefix}: dimension {dim} of {list(form.shape)} does not divide by {self.size}")
        n = full // self.size
        lo = self.rank * n
        side = ("out", "in")[dim]
        if isinstance(form, Fp8Weight):
            unit = form.block[dim] or full
            if unit < full and n % unit:
                raise SplitError(f"{prefix}: {side} {full} / {self.size} = {n} cuts an FP8 block of {unit}")
            scale = form.scale if unit >= full else form.scale.narrow(dim, lo // unit, n // unit)
            return Fp8Weight(form.q.narrow(dim, lo, n).contiguous(), scale.contiguous(), form.block)
        if dim == 0:
            return Int4Weight(form.q[lo : lo + n].contiguous(), form.scale[lo : lo + n].contiguous(),
                              form.zero[lo : lo + n].contiguous(), form.groups, form.group_size)
        if not form.contiguous_groups or n % form.group_size:
            raise SplitError(f"{prefix}: {side} {full} / {self.size} = {n} cuts an int4 group of {form.group_size}")
        g, num = lo // form.group_size, n // form.group_size
        return Int4Weight(form.q[:, lo : lo + n].contiguous(), form.scale[:, g : g + num].contiguous(),
                          form.zero[:, g : g + num].contiguous(), form.groups[lo : lo + n] - g, form.group_size)


def shard(module: nn.Module, rank: int, size: int) -> Split:
    """Make `module`'s split parameters this rank's shapes (on meta, before loading), hook the all-reduces after
    each layer's attention and MLP; return the cut the loading applies to the checkpoint's tensors."""
    fused = [n for n, _ in module.named_parameters() if _FUSED.fullmatch(n)]
    if fused:
        raise SplitError(f"this family fuses its projections ({fused[0]}): tensor parallelism splits separate "
                         "q/k/v and gate/up projections only")
    _narrow(module, size)
    layers = module.get_submodule("language_model.layers")
    assert isinstance(layers, nn.ModuleList)
    for layer in layers:
        for block in (layer.get_submodule("self_attn"), layer.get_submodule("mlp")):
            block.register_forward_hook(_all_reduce_output)
    return Split(rank, size)


def _narrow(module: nn.Module, size: int) -> None:
    for name, param in list(module.named_parameters()):
        rule = _rule(name)
        if rule is None:
            continue
        dim, _ = rule
        shape = list(param.shape)
        shape[dim] //= size
        parent, _, leaf = name.rpartition(".")
        owner = module.get_submodule(parent)
        setattr(owner, leaf, nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"), requires_grad=False))


def _all_reduce_output(module: nn.Module, args: Any, output: Any) -> Any:
    if getattr(_local, "alone", False):
        return output
    out = output[0] if isinstance(output, tuple) else output
    start = time.perf_counter()
    dist.all_reduce(out)
    CLOCK.seconds += time.perf_counter() - start
    CLOCK.calls += 1
    return output


@contextmanager
def local_forward() -> Iterator[None]:
    """Forwards on this thread skip the all-reduces (a forward one rank runs alone: the CUDA memory profile)."""
    _local.alone = True
    try:
        yield
    finally:
        _local.alone = False
