"""Wire format: [MAGIC_VERSION + msgpack header, raw tensor frame, ...]; never pickle.

The magic and version prefix the header in one frame: every frame costs a send and a receive call, and
a get round trip is dominated by such fixed costs until payloads reach several MiB.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Sequence
from typing import Any

import msgpack
import torch
import zmq

MAGIC_VERSION = b"EPDC" + bytes([2])  # version 2: magic and header share the first frame
_MAGIC_LEN = len(MAGIC_VERSION)
MAX_TENSOR_BYTES = 1 << 30  # per tensor frame, checked before any tensor is built
MAX_NDIM = 8
MAX_FRAMES = 1 + 4096  # magic+header and up to 4096 tensor frames; checked before any frame is read
MAX_HEADER_BYTES = 1 << 20  # checked before the header is unpacked
MAX_REPLY_HEADER_BYTES = 64 << 20  # consumers: a snapshot of about a million hashes
MAX_HEADER_ITEMS = 1 << 16  # longest array or map inside a header (msgpack would presize to the declared length)

# Requests the producer serves, and the replies it sends back.
REQUEST_OPS = frozenset({"get", "has", "ping", "snapshot"})
REPLY_OPS = frozenset({"get_reply", "has_reply", "pong", "snapshot_reply", "error"})
EVENT_OPS = frozenset({"event"})  # published on the producer's PUB socket, never requested
OPS = REQUEST_OPS | REPLY_OPS | EVENT_OPS

# wire name -> torch dtype; a closed table, so no dtype name is ever evaluated
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
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

Frame = bytes | bytearray | memoryview | zmq.Frame


class WireError(ValueError):
    """A message that does not follow the connector wire format."""


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """Return a flat byte view of a CPU tensor, copying only if it is not contiguous."""
    # NOTE: viewing as uint8 gives numpy a dtype it knows (bfloat16 has no numpy twin).
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def tensor_spec(t: torch.Tensor, frame: int) -> dict[str, Any]:
    """Describe a tensor for the header; `frame` indexes the tensor frames after the header."""
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {t.dtype} cannot travel on the connector wire")
    return {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "frame": frame}


def encode_message(header: dict[str, Any], tensors: Sequence[torch.Tensor | memoryview] = ()) -> list[bytes | memoryview]:
    """Frame a header and its tensors (or their byte views); send with `send_multipart(copy=False)`."""
    assert header.get("op") in OPS, f"unknown op {header.get('op')!r}"
    bufs = [t if isinstance(t, memoryview) else tensor_buffer(t) for t in tensors]
    return [MAGIC_VERSION + msgpack.packb(header, use_bin_type=True), *bufs]


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
                   max_header_bytes: int = MAX_HEADER_BYTES) -> tuple[dict[str, Any], list[memoryview]]:
    """Check a received message and return its header and tensor frame buffers.

    Producers keep the default header bound (requests carry hashes only); consumers allow larger replies
    (MAX_REPLY_HEADER_BYTES) because a snapshot lists every hash a producer holds.
    """
    if not 1 <= len(frames) <= MAX_FRAMES:
        raise WireError(f"expected 1 to {MAX_FRAMES} frames (magic+header, tensors), got {len(frames)}")
    first = as_buffer(frames[0])
    if first[:_MAGIC_LEN] != MAGIC_VERSION:  # compares without copying the frame
        raise WireError(f"bad magic/version {bytes(first[:_MAGIC_LEN])!r}, expected {MAGIC_VERSION!r}")
    header = _unpack_header(first[_MAGIC_LEN:], max_header_bytes)
    buffers = [as_buffer(f) for f in frames[1:]]
    if buffers or "items" in header:
        _check_tensor_specs(header, buffers, max_bytes)
    return header, buffers


def peek_req_id(frames: Sequence[Frame]) -> int:
    """Best-effort req_id of a message that failed to decode, or -1."""
    try:
        req_id = _unpackb(as_buffer(frames[0])[_MAGIC_LEN:]).get("req_id", -1)
    except Exception:  # noqa: BLE001 - any bytes may arrive here
        return -1
    return req_id if isinstance(req_id, int) and not isinstance(req_id, bool) else -1


def tensor_nbytes(dtype: Any, shape: Any, max_bytes: int = MAX_TENSOR_BYTES) -> int:
    """Validate a declared dtype and shape and return the byte size they need."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError(f"unknown dtype {reprlib.repr(dtype)}; known: {sorted(DTYPES)}")
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
        raise WireError(f"shape must be a list of at most {MAX_NDIM} ints, got {reprlib.repr(shape)}")
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= max_bytes:
            raise WireError(f"shape dims must be non-negative ints, none over the {max_bytes}-byte limit, "
                            f"got {reprlib.repr(shape)}")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if nbytes > max_bytes:
        raise WireError(f"declared tensor of {nbytes} bytes is over the {max_bytes}-byte limit")
    return nbytes


def tensor_from_frame(buf: Frame, dtype: Any, shape: Any, max_bytes: int = MAX_TENSOR_BYTES) -> torch.Tensor:
    """Build a tensor over a frame's memory (no copy when the buffer is writable), checking dtype and shape."""
    nbytes = tensor_nbytes(dtype, shape, max_bytes)
    view = as_buffer(buf)
    if view.nbytes != nbytes:
        raise WireError(f"frame has {view.nbytes} bytes, but {dtype}{list(shape)} needs {nbytes}")
    return frame_tensor(view, dtype, shape)


def frame_tensor(buf: Frame, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor over a frame whose dtype and shape `decode_message` has already checked."""
    view = as_buffer(buf)
    if view.nbytes == 0:
        return torch.empty(tuple(shape), dtype=DTYPES[dtype])  # frombuffer rejects empty buffers
    if view.readonly:
        # NOTE: zmq frames received with copy=False are writable; only bytes objects (tests,
        # copy=True receives) land here, and torch.frombuffer warns on read-only memory.
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=DTYPES[dtype]).view(shape)


def _unpackb(buf: memoryview, max_header_bytes: int = MAX_HEADER_BYTES) -> Any:
    """Unpack a header with every length bounded; msgpack's own stack caps nesting (StackError)."""
    if buf.nbytes > max_header_bytes:
        raise WireError(f"header of {buf.nbytes} bytes is over the {max_header_bytes}-byte limit")
    max_items = max(MAX_HEADER_ITEMS, max_header_bytes // 64)  # a snapshot lists one 64-char hash per item
    return msgpack.unpackb(
        buf, raw=False, strict_map_key=True, max_str_len=max_header_bytes, max_bin_len=max_header_bytes,
        max_array_len=max_items, max_map_len=MAX_HEADER_ITEMS, max_ext_len=0,  # no ext types on the wire
    )


def _unpack_header(buf: memoryview, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    try:
        header = _unpackb(buf, max_header_bytes)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack raises a zoo of types on bad bytes
        raise WireError(f"header is not valid msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(header, dict):
        raise WireError(f"header must be a map, got {type(header).__name__}")
    op = header.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise WireError(f"unknown op {reprlib.repr(op)}")
    if not _is_int(header.get("req_id")):
        raise WireError(f"req_id must be an int, got {reprlib.repr(header.get('req_id'))}")
    return header


def _check_tensor_specs(header: dict[str, Any], buffers: list[memoryview], max_bytes: int) -> None:
    """Every item with a `frame` key describes exactly one tensor frame."""
    items = header.get("items", [])
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise WireError("header items must be a list of maps")
    specs = [item for item in items if "frame" in item]
    if len(specs) != len(buffers):
        raise WireError(f"header describes {len(specs)} tensor frame(s), message has {len(buffers)}")
    seen: set[int] = set()
    for spec in specs:
        index = spec["frame"]
        if not _is_int(index) or not 0 <= index < len(buffers) or index in seen:
            raise WireError(f"bad or repeated tensor frame index {reprlib.repr(index)}")
        seen.add(index)
        nbytes = tensor_nbytes(spec.get("dtype"), spec.get("shape"), max_bytes)
        if buffers[index].nbytes != nbytes:
            raise WireError(f"frame {index} has {buffers[index].nbytes} bytes, header declares {nbytes}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
