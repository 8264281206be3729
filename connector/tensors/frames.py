"""Tensors on the wire: raw byte frames described by a header's (dtype, shape, frame) and built back without copies."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from connector.control.wire import MAX_TENSOR_BYTES, Frame, WireError, as_buffer, encode_message, tensor_nbytes
from connector.tensors.dtypes import DTYPES, dtype_name
from connector.tensors.shm import Segment
from epd_contracts.ec import GetItem, GetReply
from epd_contracts.embeddings import ImageFeatures

_REQ_ID_MARK = (1 << 64) - 1  # a req_id no consumer sends, so its encoding marks where a reply's req_id goes


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """Return a flat byte view of a CPU tensor, copying only if it is not contiguous."""
    # NOTE: viewing as uint8 gives numpy a dtype it knows (bfloat16 has no numpy twin).
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def tensor_from_frame(buf: Frame, dtype: str, shape: list[int], max_bytes: int = MAX_TENSOR_BYTES) -> torch.Tensor:
    """Build a tensor over a frame's memory (no copy when the buffer is writable), checking dtype and shape."""
    if dtype not in DTYPES:
        raise WireError(f"unknown dtype {dtype[:32]!r}; known: {sorted(DTYPES)}")
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


@dataclass(frozen=True, eq=False)
class WireItem:
    """An item a producer holds, with its header fields and byte views made once (it may be sent many times).

    `segment`: the shared memory its tensors live in (connector/tensors/shm.py), or None for heap tensors; either
    way the socket path sends from the tensors' memory."""

    features: ImageFeatures  # embeds (and deepstack): contiguous CPU tensors
    segment: Segment | None = None

    @property
    def nbytes(self) -> int:
        return self.features.nbytes

    @functools.cached_property
    def buffers(self) -> list[memoryview]:
        """The tensor frames: the embeddings, then the DeepStack features where the family has them."""
        deepstack = self.features.deepstack
        return [tensor_buffer(self.features.embeds), *([] if deepstack is None else [tensor_buffer(deepstack)])]

    @functools.cached_property
    def _fields(self) -> dict[str, object]:
        """The GetItem fields every reply repeats (checked and built once per held item)."""
        f = self.features
        deepstack = f.deepstack
        if deepstack is not None and deepstack.dtype != f.embeds.dtype:
            raise TypeError(f"deepstack dtype {deepstack.dtype} != embeddings dtype {f.embeds.dtype}")
        return {"found": True, "num_tokens": int(f.embeds.shape[0]), "grid_thw": f.grid_thw,
                "dtype": dtype_name(f.embeds), "shape": list(f.embeds.shape),
                "span": None if f.span is None else list(f.span),
                "deepstack_shape": None if deepstack is None else list(deepstack.shape),
                "second_per_grid_t": f.second_per_grid_t}

    def item(self, mm_hash: str, frame: int) -> GetItem:
        """This item's entry in a get_reply, its tensors in frames `frame` (and `frame + 1`)."""
        deep = None if self.features.deepstack is None else frame + 1
        return GetItem(mm_hash=mm_hash, frame=frame, deepstack_frame=deep, **self._fields)  # type: ignore[arg-type]

    @functools.cached_property
    def _replies(self) -> dict[tuple[str, bool], tuple[bytes, bytes, bool] | None]:
        return {}

    def reply_parts(self, mm_hash: str, shm: bool) -> tuple[bytes, bytes, bool] | None:
        """A single-item get_reply for this item, encoded once around its req_id: send prefix + req_id as a
        big-endian uint64 + suffix (+ `buffers` unless the third value says it went by shared-memory handle).
        None when it cannot be split (then encode the reply in full)."""
        key = (mm_hash, shm)
        if key not in self._replies:
            item = self.shm_item(mm_hash) if shm else None
            header = encode_message(GetReply(req_id=_REQ_ID_MARK, items=[item or self.item(mm_hash, 0)]))[0]
            mark = b"\xcf" + _REQ_ID_MARK.to_bytes(8, "big")  # msgpack uint64
            parts = bytes(header).split(mark)
            self._replies[key] = (parts[0] + b"\xcf", parts[1], item is not None) if len(parts) == 2 else None
        return self._replies[key]

    def shm_item(self, mm_hash: str) -> GetItem | None:
        """This item's entry answering a `shm` get: the handle of its segment (None: it has none, send frames)."""
        segment = self.segment
        if segment is None or segment.fd is None:
            return None
        return GetItem(mm_hash=mm_hash, shm=segment.handle(), **self._fields)  # type: ignore[arg-type]

    def release(self) -> None:
        """The cache dropped this item: close its segment's fd (its memory goes with the last view)."""
        if self.segment is not None:
            self.segment.close()
