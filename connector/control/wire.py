"""Wire format: [MAGIC_VERSION + msgpack header, raw tensor frame, ...]; never pickle. Torch-free.

The magic and version prefix the header in one frame: every frame costs a send and a receive call, and
a get round trip is dominated by such fixed costs until payloads reach several MiB. Headers are the
msgspec Structs of epd_contracts.ec; every declared size is checked here before any tensor is built.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from epd_contracts.ec import DTYPE_SIZES, GetReply, Message
from epd_contracts.kv import MAX_BLOCKS, KVGetReply

MAGIC_VERSION = b"EPDC" + bytes([3])  # version 3: msgspec-typed headers (v2 framing unchanged)
_MAGIC_LEN = len(MAGIC_VERSION)
MAX_TENSOR_BYTES = 1 << 30  # per tensor frame, checked before any tensor is built
MAX_FRAMES = 1 + 4096  # magic+header and up to 4096 tensor frames; checked before any frame is read
MAX_KV_FRAMES = 1 + MAX_BLOCKS  # a kv_reply: magic+header and one frame per block (a prompt's blocks travel together)
MAX_HEADER_BYTES = 1 << 20  # checked before the header is decoded
MAX_REPLY_HEADER_BYTES = 64 << 20  # consumers: a snapshot of about a million hashes

Frame = bytes | bytearray | memoryview | zmq.Frame
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class _ReqId(msgspec.Struct):
    req_id: int = -1


_PEEK = msgspec.msgpack.Decoder(_ReqId)


class WireError(ValueError):
    """A message that does not follow the connector wire format."""


def encode_message(header: Message, buffers: Sequence[memoryview] = ()) -> list[bytes | memoryview]:
    """Frame a header and its tensor byte views; send with `send_multipart(copy=False)`."""
    return [MAGIC_VERSION + _ENCODER.encode(header), *buffers]


def as_buffer(frame: Frame) -> memoryview:
    """Return a byte memoryview over a frame without copying it."""
    view = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def apply_socket_limits(sock: zmq.Socket[Any], max_bytes: int) -> None:
    """Make libzmq drop any peer that sends a message part over `max_bytes`; call before bind/connect."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


def decode_message(frames: Sequence[Frame], max_bytes: int = MAX_TENSOR_BYTES,
                   max_header_bytes: int = MAX_HEADER_BYTES,
                   max_frames: int = MAX_FRAMES) -> tuple[Message, list[memoryview]]:
    """Check a received message and return its header and tensor frame buffers.

    Producers keep the default header bound (requests carry hashes only); consumers allow larger replies
    (MAX_REPLY_HEADER_BYTES) because a snapshot lists every hash a producer holds, and a K/V consumer more frames
    (MAX_KV_FRAMES).
    """
    if not 1 <= len(frames) <= max_frames:
        raise WireError(f"expected 1 to {max_frames} frames (magic+header, tensors), got {len(frames)}")
    first = as_buffer(frames[0])
    if first[:_MAGIC_LEN] != MAGIC_VERSION:  # compares without copying the frame
        raise WireError(f"bad magic/version {bytes(first[:_MAGIC_LEN])!r}, expected {MAGIC_VERSION!r}")
    header = _decode_header(first[_MAGIC_LEN:], max_header_bytes)
    buffers = [as_buffer(f) for f in frames[1:]]
    if isinstance(header, KVGetReply):
        _check_kv_frames(header, buffers, max_bytes)
    elif buffers or isinstance(header, GetReply):
        _check_tensor_specs(header, buffers, max_bytes)
    return header, buffers


def peek_req_id(frames: Sequence[Frame]) -> int:
    """Best-effort req_id of a message that failed to decode, or -1."""
    try:
        header = as_buffer(frames[0])[_MAGIC_LEN:]
        return _PEEK.decode(header).req_id if header.nbytes <= MAX_HEADER_BYTES else -1
    except Exception:  # noqa: BLE001 - any bytes may arrive here
        return -1


def tensor_nbytes(dtype: str, shape: Sequence[int], max_bytes: int = MAX_TENSOR_BYTES) -> int:
    """The byte size a (decoded, hence typed) dtype and shape need, checked against `max_bytes`."""
    if any(dim > max_bytes for dim in shape):
        raise WireError(f"shape dims must not be over the {max_bytes}-byte limit, got {list(shape)[:8]}")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if nbytes > max_bytes:
        raise WireError(f"declared tensor of {nbytes} bytes is over the {max_bytes}-byte limit")
    return nbytes


def _decode_header(buf: memoryview, max_header_bytes: int) -> Message:
    if buf.nbytes > max_header_bytes:
        raise WireError(f"header of {buf.nbytes} bytes is over the {max_header_bytes}-byte limit")
    try:
        return _DECODER.decode(buf)
    except Exception as e:  # noqa: BLE001 - invalid bytes, a failed field check, or nesting past the stack
        raise WireError(f"bad header: {type(e).__name__}: {str(e)[:200]}") from e


def _check_tensor_specs(header: Message, buffers: list[memoryview], max_bytes: int) -> None:
    """Every tensor an item declares (`frame`, `deepstack_frame`) is exactly one frame, of the size its dtype and
    shape declare; no frame is left undescribed or described twice."""
    if not isinstance(header, GetReply):
        raise WireError(f"a {type(header).__name__} carries no tensor frames, message has {len(buffers)}")
    specs = [(item.mm_hash, index, shape, item.dtype) for item in header.items
             for index, shape in ((item.frame, item.shape), (item.deepstack_frame, item.deepstack_shape))
             if index is not None]
    if len(specs) != len(buffers):
        raise WireError(f"header describes {len(specs)} tensor frame(s), message has {len(buffers)}")
    seen: set[int] = set()
    for mm_hash, index, shape, dtype in specs:
        if index >= len(buffers) or index in seen:
            raise WireError(f"bad or repeated tensor frame index {index}")
        seen.add(index)
        if dtype is None or shape is None:
            raise WireError(f"item {mm_hash[:64]!r} has a tensor frame but no dtype and shape")
        nbytes = tensor_nbytes(dtype, shape, max_bytes)
        if buffers[index].nbytes != nbytes:
            raise WireError(f"frame {index} has {buffers[index].nbytes} bytes, header declares {nbytes}")


def _check_kv_frames(header: KVGetReply, buffers: list[memoryview], max_bytes: int) -> None:
    """A found kv_reply has a layout and one frame of `layout.block_shape` per block from `first_block`, or a
    shared-memory handle and no frame (its size is the consumer's to check, before it maps it); any other kv_reply
    has neither."""
    layout = header.layout
    if not header.found or layout is None:
        if header.found or buffers or header.shm is not None:
            raise WireError(f"a kv_reply without blocks (found={header.found}, layout={layout is not None}) "
                            f"has {len(buffers)} frame(s) and {'a' if header.shm is not None else 'no'} handle")
        return
    if header.shm is not None:
        if buffers:
            raise WireError(f"a kv_reply by shared-memory handle has {len(buffers)} frame(s)")
        return
    num_sent = header.num_blocks - header.first_block
    if num_sent != len(buffers):
        raise WireError(f"kv_reply declares blocks {header.first_block}..{header.num_blocks}, "
                        f"message has {len(buffers)} frame(s)")
    nbytes = tensor_nbytes(layout.dtype, layout.block_shape, max_bytes)
    for index, buf in enumerate(buffers):
        if buf.nbytes != nbytes:
            raise WireError(f"kv block frame {index} has {buf.nbytes} bytes, the layout declares {nbytes}")
