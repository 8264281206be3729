"""Each format's tensors for one quantized linear (prefix P), checked and read into a form (forms.py).

`check` looks at shapes and dtypes from the safetensors headers and at the scales' values only (small: the
pre-start check of a 72B checkpoint reads no weight); `read` builds the form from the tensors. Every refusal
names the tensor."""
from __future__ import annotations

import math
from typing import Protocol

import torch

from epd_models.quant.forms import Form, Fp8Weight, Int4Weight, unpack_nibbles
from epd_models.quant.scheme import QuantError, QuantScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble k of a word holds column 8c + AWQ_ORDER[k]
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# the tensors beside P that make P a quantized linear, per scheme kind (the first is the weight itself)
TENSORS = {"fp8-block": ("weight", "weight_scale_inv"), "fp8-channel": ("weight", "weight_scale"),
           "int4-ct": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"),
           "awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}
OPTIONAL = {"weight_zero_point", "g_idx"}
MARKERS = {"fp8-block": "weight_scale_inv", "fp8-channel": "weight_scale", "int4-ct": "weight_packed",
           "awq": "qweight", "gptq": "qweight"}


class Source(Protocol):
    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype] | None: ...

    def value(self, name: str) -> torch.Tensor: ...


def check(scheme: QuantScheme, prefix: str, src: Source) -> tuple[int, int]:
    """Refuse (QuantError) what is missing, misshapen or mis-scaled; return the linear's (out, in)."""
    metas = {}
    for suffix in TENSORS[scheme.kind]:
        meta = src.meta(f"{prefix}.{suffix}")
        if meta is None and suffix not in OPTIONAL:
            raise QuantError(f"tensor {prefix}.{suffix} is missing: a {scheme.label} linear needs "
                             f"{', '.join(prefix + '.' + s for s in TENSORS[scheme.kind] if s not in OPTIONAL)}")
        metas[suffix] = meta
    shape = _SHAPES[scheme.kind](scheme, prefix, metas, src)
    for suffix in ("weight_scale_inv", "weight_scale", "scales"):
        if suffix in metas and metas[suffix] is not None:
            _check_scale(f"{prefix}.{suffix}", src.value(f"{prefix}.{suffix}"))
    return shape


def read(scheme: QuantScheme, prefix: str, src: Source) -> Form:
    out, inn = check(scheme, prefix, src)
    v = src.value
    if scheme.kind == "fp8-block":
        return Fp8Weight(v(f"{prefix}.weight"), v(f"{prefix}.weight_scale_inv").float(), scheme.block)
    if scheme.kind == "fp8-channel":
        return Fp8Weight(v(f"{prefix}.weight"), v(f"{prefix}.weight_scale").float().reshape(out, 1), (1, inn))
    groups = torch.arange(inn) // scheme.group
    if scheme.kind == "int4-ct":
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # the format's own

        q = unpack_from_int32(v(f"{prefix}.weight_packed"), 4, torch.Size((out, inn)), packed_dim=1)
        scale = v(f"{prefix}.weight_scale").float()
        zero = torch.zeros_like(scale)
        if src.meta(f"{prefix}.weight_zero_point") is not None:
            zero = unpack_from_int32(v(f"{prefix}.weight_zero_point"), 4, torch.Size(scale.shape), packed_dim=0)
        return Int4Weight((q + 8).to(torch.uint8), scale, zero.float() + 8, groups, scheme.group)
    scale = v(f"{prefix}.scales").float().t().contiguous()  # (out, groups)
    if scheme.kind == "awq":
        q = unpack_nibbles(v(f"{prefix}.qweight"), 1, AWQ_ORDER).t().contiguous()  # (in, out) -> (out, in)
        zero = unpack_nibbles(v(f"{prefix}.qzeros"), 1, AWQ_ORDER).t().float()
        return Int4Weight(q, scale, zero.contiguous(), groups, scheme.group)
    q = unpack_nibbles(v(f"{prefix}.qweight"), 0).t().contiguous()  # GPTQ packs 8 input rows per word
    zero = unpack_nibbles(v(f"{prefix}.qzeros"), 1).t().float() + 1  # checkpoint format "gptq": zero - 1 stored
    if src.meta(f"{prefix}.g_idx") is not None:
        groups = v(f"{prefix}.g_idx").long()
    return Int4Weight(q, scale, zero.contiguous(), groups, scheme.group)


def _check_scale(name: str, scale: torch.Tensor) -> None:
    s = scale.float()
    bad = ~torch.isfinite(s)
    if bad.any():
        raise QuantError(f"tensor {name}: {int(bad.sum())} scale(s) are NaN or infinite")
    if (s == 0).any():
        raise QuantError(f"tensor {name}: {int((s == 0).sum())} scale(s) are zero")


def _want(name: str, meta: tuple[tuple[int, ...], torch.dtype], shape: tuple[int, ...],
          dtypes: tuple[torch.dtype, ...], why: str = "") -> None:
    got, dtype = meta
    if tuple(got) != tuple(shape):
        raise QuantError(f"tensor {name}: shape {list(got)}, expected {list(shape)}{why}")
    if dtype not in dtypes:
        raise QuantError(f"tensor {name}: dtype {dtype}, expected {' or '.join(str(d) for d in dtypes)}")


def _two_d(name: str, meta: tuple[tuple[int, ...], torch.dtype]) -> tuple[int, int]:
    if len(meta[0]) != 2:
        raise QuantError(f"tensor {name}: shape {list(meta[0])}, expected 2 dimensions")
    return meta[0][0], meta[0][1]


def _fp8_shape(scheme: QuantScheme, p: str, metas: dict, src: Source) -> tuple[int, int]:
    out, inn = _two_d(f"{p}.weight", metas["weight"])
    _want(f"{p}.weight", metas["weight"], (out, inn), (torch.float8_e4m3fn,))
    if scheme.kind == "fp8-channel":
        scale = metas["weight_scale"]
        _want(f"{p}.weight_scale", scale, (out, 1) if len(scale[0]) == 2 else (out,), FLOATS, " (one per row)")
        return out, inn
    rows, cols = scheme.block
    _want(f"{p}.weight_scale_inv", metas["weight_scale_inv"], (math.ceil(out / rows), math.ceil(inn / cols)),
          FLOATS, f" (weight_block_size {rows}x{cols} over {out}x{inn})")
    return out, inn


def _ct_shape(scheme: QuantScheme, p: str, metas: dict, src: Source) -> tuple[int, int]:
    _want(f"{p}.weight_shape", metas["weight_shape"], (2,), (torch.int64, torch.int32))
    out, inn = (int(x) for x in src.value(f"{p}.weight_shape").tolist())
    g = scheme.group
    _want(f"{p}.weight_packed", metas["weight_packed"], (out, math.ceil(inn / 8)), (torch.int32,),
          f" (weight_shape {out}x{inn}, 8 values per int32)")
    _want(f"{p}.weight_scale", metas["weight_scale"], (out, math.ceil(inn / g)), FLOATS, f" (group_size {g})")
    zp = metas.get("weight_zero_point")
    if scheme.symmetric and zp is not None:
        raise QuantError(f"tensor {p}.weight_zero_point: the config says symmetric")
    if not scheme.symmetric:
        if zp is None:
            raise QuantError(f"tensor {p}.weight_zero_point is missing: the config says asymmetric")
        _want(f"{p}.weight_zero_point", zp, (math.ceil(out / 8), math.ceil(inn / g)), (torch.int32,))
    return out, inn


def _int4_shape(scheme: QuantScheme, p: str, metas: dict, src: Source) -> tuple[int, int]:
    a, b = _two_d(f"{p}.qweight", metas["qweight"])
    inn, out = (a, b * 8) if scheme.kind == "awq" else (a * 8, b)
    g = scheme.group
    if inn % g:
        raise QuantError(f"tensor {p}.qweight: {inn} input columns are not a multiple of group_size {g}")
    _want(f"{p}.qweight", metas["qweight"], (a, b), (torch.int32,))
    _want(f"{p}.qzeros", metas["qzeros"], (inn // g, out // 8), (torch.int32,), f" (group_size {g}, {inn}x{out})")
    _want(f"{p}.scales", metas["scales"], (inn // g, out), FLOATS, f" (group_size {g}, {inn} inputs, {out} outputs)")
    if metas.get("g_idx") is not None:
        _want(f"{p}.g_idx", metas["g_idx"], (inn,), (torch.int32, torch.int64))
        idx = src.value(f"{p}.g_idx")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= inn // g):
            raise QuantError(f"tensor {p}.g_idx: group indices outside 0..{inn // g - 1}")
    return out, inn


_SHAPES = {"fp8-block": _fp8_shape, "fp8-channel": _fp8_shape, "int4-ct": _ct_shape, "awq": _int4_shape,
           "gptq": _int4_shape}
