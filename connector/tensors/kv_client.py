"""A decode worker's side of the K/V hand-off: fetch a prompt's blocks from its prefill worker, or say why not.

Every failure is one exception, KVUnavailable, raised within the timeout (the decode worker then recomputes the
prefill, so the request never fails for it). Nothing is returned before the reply is checked against what this
worker asked for, its own model's layout: decode_message checks the frames against the reply's layout (count,
byte lengths), the layout must equal the asked one exactly, the counts must agree, and every frame's values must be
finite before it is copied into the one blocks tensor returned (frames are separate buffers: one copy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from connector.control.client import ProducerClient, Reply
from connector.control.security import CurveConfig
from connector.control.wire import MAX_KV_FRAMES, MAX_TENSOR_BYTES
from connector.tensors.errors import KVUnavailable
from connector.tensors.frames import DTYPES, tensor_buffer
from connector.tensors.kv_checks import MAX_KV_REPLY_BYTES, extent_error, layout_difference
from epd_contracts.ec import ErrorReply
from epd_contracts.kv import MAX_BLOCKS, MAX_CHOICES, KVChoice, KVGetReply, KVGetRequest, KVLayout

# wire dtype -> (the unsigned integer of its width, +inf's bits): a value is NaN or infinite exactly when its bits,
# the sign cleared, are at least +inf's (its exponent all ones)
_INF_BITS: dict[str, tuple[type[np.unsignedinteger[Any]], int]] = {
    "bfloat16": (np.uint16, 0x7F80), "float16": (np.uint16, 0x7C00),
    "float32": (np.uint32, 0x7F80_0000), "float64": (np.uint64, 0x7FF0_0000_0000_0000),
}


@dataclass(frozen=True, eq=False)
class KVFetched:
    """A hand-off's blocks from `first_block` on (block i of the prompt is `blocks[i - first_block]`)."""

    num_tokens: int
    num_blocks: int
    first_block: int
    blocks: torch.Tensor = field(repr=False)  # CPU (num_blocks - first_block, *layout.block_shape), layout's dtype
    choices: list[KVChoice]


class KVClient:
    """Fetches hand-offs over pooled DEALER sockets (connector/control/client.py); thread-safe."""

    def __init__(self, curve: CurveConfig | None = None, max_message_bytes: int = MAX_TENSOR_BYTES,
                 max_reply_bytes: int = MAX_KV_REPLY_BYTES) -> None:
        """`max_message_bytes` bounds each block frame, `max_reply_bytes` all of one reply's."""
        self._client = ProducerClient(curve, max_message_bytes, max_reply_bytes, MAX_KV_FRAMES)

    def fetch(self, address: str, key: str, layout: KVLayout, first_block: int = 0,
              timeout: float = 10.0) -> KVFetched:
        """The blocks of hand-off `key` from `first_block` on, for a model of `layout`; KVUnavailable otherwise."""
        request = KVGetRequest(req_id=self._client.next_req_id(), key=key, layout=layout, first_block=first_block)
        try:
            reply = self._client.exchange_one(address, request, timeout)
        except zmq.ZMQError as e:
            raise KVUnavailable(f"cannot reach {address}: {e}") from e
        header, buffers = _checked(reply, request, address, timeout)
        return KVFetched(num_tokens=header.num_tokens, num_blocks=header.num_blocks, first_block=header.first_block,
                         blocks=_blocks(layout, first_block, buffers), choices=list(header.choices))

    def close(self) -> None:
        self._client.close()


def _checked(reply: Reply | None, request: KVGetRequest, address: str,
             timeout: float) -> tuple[KVGetReply, list[memoryview]]:
    """The reply if it answers `request` with blocks that fit its layout; KVUnavailable naming why not."""
    if reply is None:
        raise KVUnavailable(f"no reply from {address} within {timeout}s (down, unreachable, or refusing our key)")
    header, buffers = reply
    if isinstance(header, ErrorReply):
        raise KVUnavailable(f"error from {address}: {header.message[:512]}")
    if not isinstance(header, KVGetReply) or header.req_id != request.req_id or header.key != request.key:
        raise KVUnavailable(f"{address} answered another request ({type(header).__name__} {header.req_id})")
    if not header.found:
        raise KVUnavailable(f"{address} has no {request.key!r}: {header.error[:512] or 'not found'}")
    if error := _reply_error(header, request, len(buffers)):
        raise KVUnavailable(f"bad kv_reply from {address}: {error}")
    return header, buffers


def _reply_error(header: KVGetReply, request: KVGetRequest, num_frames: int) -> str:
    """Why a found reply does not fit `request` ("" when it does)."""
    layout = request.layout
    if header.layout != layout:
        return f"layout differs: {layout_difference(layout, header.layout)}"
    if header.first_block != request.first_block:
        return f"blocks from {header.first_block}, asked from {request.first_block}"
    if not header.first_block <= header.num_blocks <= MAX_BLOCKS:
        return f"first_block {header.first_block} of {header.num_blocks} block(s)"
    if error := extent_error(layout, header.num_tokens, header.num_blocks):
        return error
    if not 1 <= len(header.choices) <= MAX_CHOICES:
        return f"{len(header.choices)} choice(s), not 1 to {MAX_CHOICES}"
    # NOTE: decode_message checked the frames against the reply's layout, just found equal to ours; asserted again
    assert num_frames == header.num_blocks - header.first_block, "decode_message checks the kv frame count"
    return ""


def _blocks(layout: KVLayout, first_block: int, buffers: list[memoryview]) -> torch.Tensor:
    """The blocks as one CPU tensor, each frame checked finite before it is copied in."""
    out = torch.empty((len(buffers), *layout.block_shape), dtype=DTYPES[layout.dtype])
    view = tensor_buffer(out)
    size = view.nbytes // len(buffers) if buffers else 0  # every frame's length, checked by decode_message
    for i, buf in enumerate(buffers):
        if not _finite(buf, layout.dtype):
            raise KVUnavailable(f"block {first_block + i} has non-finite values")
        view[i * size:(i + 1) * size] = buf  # a memcpy on this thread
    return out


def _finite(buf: memoryview, dtype: str) -> bool:
    """Whether every value in a frame is finite (integers always are), read from the bits.

    NOTE: numpy on this thread, not torch: `torch.isfinite(...).all()` on bfloat16 blocks is ~10x slower on CPU and
    runs in torch's thread pool, which a concurrent engine step may hold."""
    if dtype not in _INF_BITS:
        return True
    uint, inf = _INF_BITS[dtype]
    bits = np.frombuffer(buf, dtype=uint)
    return int(np.bitwise_and(bits, np.iinfo(uint).max >> 1).max()) < inf
