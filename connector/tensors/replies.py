"""A `get_reply` built from held items (producer) and read back into features (consumer)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from connector.control.wire import MAX_TENSOR_BYTES, WireError, tensor_nbytes
from connector.tensors.frames import WireItem, frame_tensor
from connector.tensors.shm import ShmError, mapped_tensor, open_handle
from epd_contracts.ec import GetItem, GetReply, ShmHandle
from epd_contracts.embeddings import ImageFeatures

if TYPE_CHECKING:
    import torch


def get_reply(req_id: int, hashes: list[str], found: dict[str, WireItem], failed: frozenset[str] = frozenset(),
              max_bytes: int | None = None, shm: bool = False,
              later: frozenset[str] = frozenset()) -> tuple[GetReply, list[memoryview]]:
    """Header and tensor frames answering a `get`: one item per requested hash (`failed`: encoding failed; `later`:
    held but not read for this reply, answered `more`).
    With `shm`, found items held in shared memory are answered by handle (GetItem.shm), the others by frames.

    With `max_bytes`, found items past that many tensor bytes (by handle or by frame) are left out with `more`
    (ask again); the first found item always goes (each is bounded by the frame limit).
    """
    items: list[GetItem] = []
    frames: list[memoryview] = []
    total = 0
    for mm_hash in hashes:
        held = found.get(mm_hash)
        if held is None:
            items.append(GetItem(mm_hash=mm_hash, failed=mm_hash in failed, more=mm_hash in later))
        elif max_bytes is not None and total and total + held.nbytes > max_bytes:
            items.append(GetItem(mm_hash=mm_hash, more=True))
        else:
            total += held.nbytes or 1  # an empty item still counts as sent
            by_handle = held.shm_item(mm_hash) if shm else None
            if by_handle is not None:
                items.append(by_handle)
            else:
                items.append(held.item(mm_hash, len(frames)))
                frames.extend(held.buffers)
    return GetReply(req_id=req_id, items=items), frames


def parse_get_reply(header: GetReply, buffers: list[memoryview]) -> dict[str, ImageFeatures]:
    """The found items of a decoded `get_reply` (decode_message checked their frames), keyed by mm_hash;
    WireError for an item sent by shared-memory handle (see read_get_reply)."""
    found, unmapped = read_get_reply(header, buffers, None)
    if unmapped:
        raise WireError(f"get_reply has {len(unmapped)} shared-memory item(s) this consumer did not ask for")
    return found


def read_get_reply(header: GetReply, buffers: list[memoryview], shm_pid: int | None,
                   max_bytes: int = MAX_TENSOR_BYTES) -> tuple[dict[str, ImageFeatures], dict[str, str]]:
    """The found items of a decoded `get_reply`, and mm_hash -> why for those whose shared-memory handle could
    not be mapped (ask for them again by socket). `shm_pid`: the producer pid this consumer probed, None if none.

    A malformed item (shapes, frames) is a WireError for the whole reply, as on the socket path.
    """
    found: dict[str, ImageFeatures] = {}
    unmapped: dict[str, str] = {}
    for item in header.items:
        if not item.found:
            continue
        dtype, shape = item.dtype, item.shape
        if dtype is None or shape is None or (item.frame is None) == (item.shm is None):
            raise WireError(f"get_reply item {item.mm_hash[:64]!r} is found but has no tensor frame or handle")
        if not shape or item.num_tokens != shape[0]:
            raise WireError(f"get_reply item {item.mm_hash[:64]!r}: num_tokens does not match shape {shape}")
        deep_shape = _deepstack_shape(item, shape)
        if item.frame is not None:
            embeds = frame_tensor(buffers[item.frame], dtype, shape)
            deep_frame = item.deepstack_frame
            deepstack = None if deep_shape is None or deep_frame is None else frame_tensor(buffers[deep_frame], dtype,
                                                                                             deep_shape)
        else:
            assert item.shm is not None  # checked above: a frame or a handle
            try:
                embeds, deepstack = _mapped(item.shm, shm_pid, dtype, shape, deep_shape, max_bytes)
            except ShmError as e:
                unmapped[item.mm_hash] = str(e)
                continue
        found[item.mm_hash] = ImageFeatures(embeds, item.grid_thw, span=None if item.span is None else tuple(item.span),
                                            deepstack=deepstack, second_per_grid_t=item.second_per_grid_t)
    return found, unmapped


def _deepstack_shape(item: GetItem, main: list[int]) -> list[int] | None:
    """A found item's DeepStack shape, (layers, *main): by frame, both its frame and shape or neither; by handle,
    a shape and never a frame."""
    shape = item.deepstack_shape
    if item.shm is None and item.deepstack_frame is None and shape is None:
        return None
    if item.shm is not None and item.deepstack_frame is None and shape is None:
        return None
    if (item.deepstack_frame is None) != (item.shm is not None) or shape is None or len(shape) != 1 + len(main) \
            or shape[1:] != main:
        raise WireError(f"get_reply item {item.mm_hash[:64]!r}: DeepStack frame {item.deepstack_frame} of shape "
                        f"{shape} does not go with features of shape {main}")
    return shape


def _mapped(handle: ShmHandle, pid: int | None, dtype: str, shape: list[int], deep_shape: list[int] | None,
            max_bytes: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An item's tensors over its producer's segment, mapped copy-on-write (ShmError when it cannot be)."""
    if pid is None:
        raise ShmError("shared-memory item from a producer this consumer has not probed")
    try:
        main = tensor_nbytes(dtype, shape, max_bytes)
        extra = 0 if deep_shape is None else tensor_nbytes(dtype, deep_shape, max_bytes)
    except WireError as e:
        raise ShmError(str(e)) from None
    mapping = open_handle(handle, pid, main + extra)
    embeds = mapped_tensor(mapping, 0, dtype, shape)
    return embeds, None if deep_shape is None else mapped_tensor(mapping, main, dtype, deep_shape)


def more_of(header: GetReply) -> list[str]:
    """Hashes a `get_reply` left out for its byte limit (held, but to be asked for again)."""
    return [item.mm_hash for item in header.items if not item.found and item.more]
