"""The connector wire's dtype names and the torch dtypes they stand for, both ways (the contract's closed table)."""
from __future__ import annotations

import torch

from epd_contracts.ec import DTYPE_SIZES, DType

# wire name -> torch dtype; the names and sizes are the contract's closed table
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
DTYPE_NAMES: dict[torch.dtype, DType] = {dtype: name for name, dtype in DTYPES.items()}  # type: ignore[misc]
assert all(DTYPES[name].itemsize == size for name, size in DTYPE_SIZES.items()) and DTYPES.keys() == DTYPE_SIZES.keys()


def dtype_name(t: torch.Tensor) -> DType:
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {t.dtype} cannot travel on the connector wire")
    return DTYPE_NAMES[t.dtype]
