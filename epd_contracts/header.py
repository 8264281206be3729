"""The base every connector message shares and the scalar types they use, apart so both ec.py and kv.py build on it.

ec.py unites every connector message (its Request/Reply unions are what the wire decodes), so it imports kv.py's
structs; kv.py cannot import ec.py back without a cycle. Torch-free: every process imports it.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_TOKEN_ID = (1 << 31) - 1
# wire dtype name -> bytes per element; a closed table, so no dtype name is ever evaluated
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
DType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8"]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


class _Header(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    req_id: int
