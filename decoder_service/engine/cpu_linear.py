"""CPU linears through oneDNN's prepacked matmul: the default on the CPU (`--cpu-exact-linear` turns it off).

MKL's sgemm, what `F.linear` calls on this CPU, costs a small batch of rows about as much as that many single rows
(1024 x 2816 fp32, 2 cores: 0.26 ms for 1 row, 1.09 ms for 4, 1.37 ms for 16), which is most of a decode step.
oneDNN with the weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`, what vLLM's CPU build relies on)
took 0.16 / 0.29 / 0.72 ms, and is no slower for prefill-sized inputs either (one pinned thread: 0.85-0.88 of
`F.linear`'s time at 256 rows, 0.83-0.93 at 2048; `python -m epd_bench.cpu_linear`, docs/BENCHMARKS.md "Fastest by
default"). So every input goes through the
packed weight and the original is dropped. NOTE: the originals are views of the checkpoint's memory-mapped file
(epd_models/weights.py), which the embeddings keep mapped; packing read every page of them, so `drop_clean_pages`
gives those clean pages back (the few the embeddings and norms use are read again on use): the LM's linear
weights are then held once.

The numbers differ from `F.linear`'s in the last bits (5e-6 relative), so greedy tokens may differ from
transformers' `generate()` where two logits are that close: `--cpu-exact-linear` keeps `F.linear`. The parity tests
against transformers run a `LanguageHalf` without an engine, which never packs. oneDNN picks its kernel by the
input's rows, so at real shapes a row's result can differ in the last bits with the rows beside it (1024 x 2816: one
row alone against 64 together), as in vLLM's CPU build; the engine tests' batched == solo checks run shapes where it
does not.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import nn


class PackedLinear(nn.Module):
    """An fp32 nn.Linear whose weight lives only in oneDNN's prepacked layout (the plain weight is not kept)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.num_packed_parameters = linear.in_features * linear.out_features  # /health's count (loaded_summary)
        self.bias = linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(module: nn.Module) -> int:
    """Every float32 nn.Linear under `module` (on the CPU) replaced by a PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
            setattr(module, name, PackedLinear(child))
            count += 1
        elif not isinstance(child, PackedLinear):
            count += pack_linears(child)
    return count


def pack_model(module: nn.Module) -> str:
    """pack_linears, then drop_clean_pages (the originals' pages, which packing read); what was done, for the log."""
    count = pack_linears(module)
    return f"{count} linears prepacked for oneDNN, {drop_clean_pages() >> 20} MiB of checkpoint pages given back"


def drop_clean_pages(suffix: str = ".safetensors") -> int:
    """Linux: madvise(MADV_DONTNEED) every mapping of a `suffix` file with no dirty or anonymous page (clean file
    pages: dropped here, read from the file again if touched); the bytes it held resident. Elsewhere: 0."""
    try:
        libc, lines = ctypes.CDLL(None, use_errno=True), Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    dropped, span = 0, None
    stats: dict[str, int] = {}  # smaps field -> kB, of the mapping `span` (start, end)
    for line in [*lines, "0-0 ---p 0 0:0 0"]:  # a sentinel header ends the last mapping
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            if span and stats.get("Rss:", 0) and not stats.get("Private_Dirty:", 0) + stats.get("Anonymous:", 0) \
                    and libc.madvise(ctypes.c_void_p(span[0]), ctypes.c_size_t(span[1] - span[0]), 4) == 0:
                dropped += stats["Rss:"] * 1024  # 4: MADV_DONTNEED
            start, end = (int(x, 16) for x in head[0].split("-"))
            span, stats = ((start, end) if head[-1].endswith(suffix) else None), {}
        elif span and head[0] in ("Rss:", "Private_Dirty:", "Anonymous:"):
            stats[head[0]] = int(head[1])
    return dropped


def available() -> bool:
    ops: Any = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")


def wanted(exact: bool, device: torch.device) -> bool:
    """Whether an engine on `device` packs its linears: on the CPU unless --cpu-exact-linear, where oneDNN is."""
    return not exact and device.type == "cpu" and available()
