"""Per-linear quantizers for epd_builders.quantize: one function per published checkpoint format.

Each takes an unquantized weight W [out, inn] and returns the tensors the format stores
in place of `P.weight` (local names, e.g. "qweight") together with the dequantized weight in float32, computed
from exactly the stored tensors, so a builder's twin checkpoint is what a correct loader must reproduce.
They are written from the formats' published descriptions, not from any loader in this project, so the two
cross-check each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a packed column holds output column 8c + AWQ_ORDER[i]


@dataclass
class Quantized:
    """What one quantized linear becomes: its stored tensors (local names) and the float32 dequantized weight."""
    tensors: dict[str, torch.Tensor]
    dequant: torch.Tensor  # float32 [out, inn]


def fp8_block(w: torch.Tensor, block: int) -> Quantized:
    """transformers FineGrainedFP8 ("fp8"): e4m3 weight, float32 `weight_scale_inv` per [block x block] tile.

    Tiles at the right/bottom edge may be partial (scale grid is ceil(out/B) x ceil(inn/B)); zero-padding them
    leaves each tile's amax unchanged.
    """
    out, inn = w.shape
    rows, cols = math.ceil(out / block), math.ceil(inn / block)
    padded = torch.nn.functional.pad(w.float(), (0, cols * block - inn, 0, rows * block - out))
    tiles = padded.reshape(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.float32)
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = (q.float() * scale_inv[:, None, :, None]).reshape(rows * block, cols * block)[:out, :inn]
    q = q.reshape(rows * block, cols * block)[:out, :inn].contiguous()
    return Quantized({"weight": q, "weight_scale_inv": scale_inv}, deq.contiguous())


def fp8_experts(fused: torch.Tensor, down: bool, dims: tuple[int, int],
                block: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """FP8 MoE releases store one tensor per expert: `{e}.{gate,up,down}_proj.weight` (+ `weight_scale_inv`),
    each [out, in] like an nn.Linear. The fused tensor may come in either orientation (transformers' own loader
    takes both, transposing only when the shape differs from its parameter's): transformers' [E, 2*inter, hidden]
    / [E, hidden, inter] (what it saves), or the original releases' transpose; gate rows come before up rows.
    Returns the per-expert tensors and the dequantized fused tensor (float32, the input's orientation)."""
    hidden, inter = dims
    linear_shape = (hidden, inter) if down else (2 * inter, hidden)
    transposed = tuple(fused.shape[1:]) != linear_shape
    rt = fused.transpose(1, 2) if transposed else fused
    if tuple(rt.shape[1:]) != linear_shape:
        raise ValueError(f"fused experts {list(fused.shape)} fit neither orientation of {linear_shape}")
    parts = {"down_proj": slice(None)} if down else {"gate_proj": slice(0, inter), "up_proj": slice(inter, None)}
    deq = torch.empty(rt.shape, dtype=torch.float32)
    out: dict[str, torch.Tensor] = {}
    for e in range(rt.shape[0]):
        for name, rows in parts.items():
            res = fp8_block(rt[e][rows], block)
            out.update({f"{e}.{name}.{local}": t.contiguous() for local, t in res.tensors.items()})
            deq[e][rows] = res.dequant
    return out, (deq.transpose(1, 2) if transposed else deq).contiguous()


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret non-negative int64 values < 2**32 as the int32 with the same bits (packed words use bit 31)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[n, m] 4-bit values -> int32 [n/8, m]: row 8r+j goes to bits 4j..4j+3 of row r (GPTQ qweight)."""
    q = q.to(torch.int64).reshape(q.shape[0] // 8, 8, q.shape[1])
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 8, 1)
    return _to_int32((q << shifts).sum(dim=1))


def pack_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[n, m] 4-bit values -> int32 [n, m/8]: nibble i of column c holds column 8c + order[i]."""
    q = q.to(torch.int64).reshape(q.shape[0], q.shape[1] // 8, 8)[:, :, list(order)]
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8)
    return _to_int32((q << shifts).sum(dim=2))


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """W [out, inn] as float32 [out, inn/group, group]; groups run along the input dimension."""
    out, inn = w.shape
    if inn % group:
        raise ValueError(f"in_features {inn} is not a multiple of group size {group}")
    return w.float().reshape(out, inn // group, group)


def awq_gemm(w: torch.Tensor, group: int) -> Quantized:
    """AutoAWQ GEMM, 4-bit asymmetric with zero point, round-to-nearest (no activation-aware search).

    scale = (max-min)/15 per group (stored float16 and used as stored), zero = clamp(round(-min/scale), 0, 15),
    q = clamp(round(w/scale) + zero, 0, 15); dequant (q - zero) * scale.
    """
    g = _groups(w, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16).float()
    zero = (-torch.round(lo / scale)).clamp(0, 15)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    deq = ((q - zero[..., None]) * scale[..., None]).reshape(w.shape)
    tensors = {
        "qweight": pack_cols(q.reshape(w.shape).t(), AWQ_ORDER),  # [inn, out/8]
        "qzeros": pack_cols(zero.t(), AWQ_ORDER),  # [inn/G, out/8]
        "scales": scale.t().to(torch.float16).contiguous(),  # [inn/G, out]
    }
    return Quantized(tensors, deq)


def gptq_v1(w: torch.Tensor, group: int) -> Quantized:
    """AutoGPTQ/GPTQModel "gptq" (v1) checkpoint, 4-bit symmetric, desc_act false, round-to-nearest (no Hessian).

    GPTQ's symmetric rule: amax = max(|min|, |max|) per group, scale = 2*amax/15 (maxq 15), zero = 8;
    q = clamp(round(w/scale) + 8, 0, 15); the v1 format stores zero - 1 (7) in qzeros.
    """
    g = _groups(w, group)
    amax = torch.maximum(g.amin(dim=2).abs(), g.amax(dim=2))
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))  # GPTQ: an all-zero group gets the range [-1, 1]
    scale = (2 * amax / 15).to(torch.float16).float()
    zero = torch.full_like(scale, 8.0)
    q = (torch.round(g / scale[..., None]) + 8).clamp(0, 15)
    deq = ((q - zero[..., None]) * scale[..., None]).reshape(w.shape)
    inn = w.shape[1]
    tensors = {
        "qweight": pack_rows(q.reshape(w.shape).t()),  # [inn/8, out]
        "qzeros": pack_cols((zero - 1).t()),  # [inn/G, out/8]
        "scales": scale.t().to(torch.float16).contiguous(),  # [inn/G, out]
        "g_idx": (torch.arange(inn) // group).to(torch.int32),
    }
    return Quantized(tensors, deq)


def ct_scheme(fmt: str, group: int) -> object:
    """The compressed-tensors QuantizationScheme of a ct-* format (the library's FP8_DYNAMIC / W4A16 presets)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("FP8_DYNAMIC" if fmt == "ct-fp8" else "W4A16", ["Linear"])
    assert scheme.weights is not None
    if fmt == "ct-w4a16":
        scheme.weights.group_size = group
    scheme.format = ct_format_name(fmt)  # what llm-compressor's save records per group (infer_model_format)
    return scheme


def ct_compress(w: torch.Tensor, fmt: str, scheme: object) -> Quantized:
    """Quantize with compressed-tensors itself: its min-max qparams (calculate_qparams, the calculation
    llm-compressor's default observer feeds) and its compressor for the format; the dequantized weight comes from
    the same compressor's decompress."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme, QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams

    assert isinstance(scheme, QuantizationScheme) and scheme.weights is not None
    args = scheme.weights
    if args.strategy == QuantizationStrategy.CHANNEL:
        lo, hi = w.float().amin(dim=1, keepdim=True), w.float().amax(dim=1, keepdim=True)
    else:
        g = _groups(w, int(args.group_size))
        lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale, zp = calculate_qparams(lo, hi, args)
    state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zp}
    compressor = BaseCompressor.get_value_from_registry(ct_format_name(fmt))
    packed = compressor.compress(state, scheme)
    deq = compressor.decompress(dict(packed), scheme)["weight"]
    return Quantized(dict(packed), deq.float())


def ct_format_name(fmt: str) -> str:
    """The compressed-tensors CompressionFormat value a ct-* format writes."""
    from compressed_tensors.config import CompressionFormat

    return {"ct-fp8": CompressionFormat.float_quantized, "ct-w4a16": CompressionFormat.pack_quantized}[fmt].value
