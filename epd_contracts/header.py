"""The base every connector message shares and the types they use, apart so both ec.py and kv.py build on it.

ec.py unites every connector message (its Request/Reply unions are what the wire decodes), so it imports kv.py's
structs; kv.py cannot import ec.py back without a cycle. So what both use lives here: the scalar types, and the
shared-memory handle that answers an embeddings `get` (ec.py GetItem.shm) and a K/V `kv_get` (kv.py KVGetReply.shm)
alike. Torch-free: every process imports it.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_TOKEN_ID = (1 << 31) - 1
SHM_TAG_BYTES = 16  # random bytes heading every shared-memory segment; a handle must name them
MAX_PID = (1 << 22)  # Linux's pid_max ceiling
MAX_FD = (1 << 30)  # file descriptor numbers a handle may name (RLIMIT_NOFILE is far lower)
# wire dtype name -> bytes per element; a closed table, so no dtype name is ever evaluated
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
DType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8"]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
ShmTag = Annotated[bytes, msgspec.Meta(min_length=SHM_TAG_BYTES, max_length=SHM_TAG_BYTES)]


class _Header(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    req_id: int


class ShmHandle(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A producer's shared-memory segment, opened by a same-host consumer at /proc/<pid>/fd/<fd>.

    The segment is `size` bytes: `tag` (SHM_TAG_BYTES random bytes, checked after mapping: fd numbers are reused,
    the tag is not), then the payload (connector/tensors/shm.py): an item's embeddings and then its DeepStack
    features if any (ec.py GetItem), or a hand-off's blocks, all of them back to back (kv.py KVGetReply)."""

    pid: Annotated[int, msgspec.Meta(gt=0, le=MAX_PID)]
    fd: Annotated[int, msgspec.Meta(ge=0, le=MAX_FD)]
    tag: ShmTag
    size: NonNegative
