"""Tensors on the wire: raw byte frames described by a header's (dtype, shape, frame) and built back without copies."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from connector.control.wire import MAX_TENSOR_BYTES, Frame, WireError, as_buffer, tensor_nbytes
from epd_contracts.ec import DTYPE_SIZES, DType, GetItem
from epd_contracts.embeddings import ImageFeatures

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


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """Return a flat byte view of a CPU tensor, copying only if it is not contiguous."""
    # NOTE: viewing as uint8 gives numpy a dtype it knows (bfloat16 has no numpy twin).
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def dtype_name(t: torch.Tensor) -> DType:
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype {t.dtype} cannot travel on the connector wire")
    return DTYPE_NAMES[t.dtype]


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
    """An item a producer holds, with its header fields and byte views made once (it may be sent many times)."""

    features: ImageFeatures  # embeds (and deepstack): contiguous CPU tensors

    @property
    def nbytes(self) -> int:
        return self.features.nbytes

    @functools.cached_property
    def buffers(self) -> list[memoryview]:
        """The tensor frames: the embeddings, then the DeepStack features where the family has them."""
        deepstack = self.features.deepstack
        return [tensor_buffer(self.features.embeds), *([] if deepstack is None else [tensor_buffer(deepstack)])]

    def item(self, mm_hash: str, frame: int) -> GetItem:
        """This item's entry in a get_reply, its tensors in frames `frame` (and `frame + 1`)."""
        f = self.features
        deepstack = f.deepstack
        if deepstack is not None and deepstack.dtype != f.embeds.dtype:
            raise TypeError(f"deepstack dtype {deepstack.dtype} != embeddings dtype {f.embeds.dtype}")
        return GetItem(mm_hash=mm_hash, found=True, num_tokens=int(f.embeds.shape[0]), grid_thw=f.grid_thw,
                       dtype=dtype_name(f.embeds), shape=list(f.embeds.shape), frame=frame,
                       span=None if f.span is None else list(f.span),
                       deepstack_shape=None if deepstack is None else list(deepstack.shape),
                       deepstack_frame=None if deepstack is None else frame + 1,
                       second_per_grid_t=f.second_per_grid_t)
