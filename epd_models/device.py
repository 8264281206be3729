"""Where a half's tensors live and in what dtype: `resolve_device` (auto, cpu, cuda, cuda:N, checked against what this
machine has) and `_dtype` (an explicit dtype, else the checkpoint's)."""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'; ValueError for what cannot be used here."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"invalid device {str(device)!r}: expected auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} requested but CUDA is not available (torch {torch.__version__})")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ValueError(f"unsupported device {str(device)!r}: expected auto, cpu, cuda or cuda:N")
    return torch.device("cpu")


def _dtype(cfg: object, dtype: torch.dtype | str | None) -> torch.dtype:
    """An explicit dtype (or its name) wins; None / 'auto' is the checkpoint's own dtype, else float32."""
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: expected auto or one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found)
    return found if isinstance(found, torch.dtype) else torch.float32
