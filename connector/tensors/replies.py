"""A `get_reply` built from held items (producer) and read back into features (consumer)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from connector.control.wire import WireError
from connector.tensors.frames import WireItem, frame_tensor
from epd_contracts.ec import GetItem, GetReply
from epd_contracts.embeddings import ImageFeatures

if TYPE_CHECKING:
    import torch


def get_reply(req_id: int, hashes: list[str], found: dict[str, WireItem], failed: frozenset[str] = frozenset(),
              max_bytes: int | None = None) -> tuple[GetReply, list[memoryview]]:
    """Header and tensor frames answering a `get`: one item per requested hash (`failed`: encoding failed).

    With `max_bytes`, found items past that many tensor bytes are left out with `more` (ask again);
    the first found item always goes (each is bounded by the frame limit).
    """
    items: list[GetItem] = []
    frames: list[memoryview] = []
    total = 0
    for mm_hash in hashes:
        held = found.get(mm_hash)
        if held is None:
            items.append(GetItem(mm_hash=mm_hash, failed=mm_hash in failed))
        elif max_bytes is not None and frames and total + held.nbytes > max_bytes:
            items.append(GetItem(mm_hash=mm_hash, more=True))
        else:
            total += held.nbytes
            items.append(held.item(mm_hash, len(frames)))
            frames.extend(held.buffers)
    return GetReply(req_id=req_id, items=items), frames


def parse_get_reply(header: GetReply, buffers: list[memoryview]) -> dict[str, ImageFeatures]:
    """The found items of a decoded `get_reply` (decode_message checked their frames), keyed by mm_hash."""
    found: dict[str, ImageFeatures] = {}
    for item in header.items:
        if not item.found:
            continue
        if item.frame is None or item.dtype is None or item.shape is None:
            raise WireError(f"get_reply item {item.mm_hash[:64]!r} is found but has no tensor frame")
        if not item.shape or item.num_tokens != item.shape[0]:
            raise WireError(f"get_reply item {item.mm_hash[:64]!r}: num_tokens does not match shape {item.shape}")
        deepstack = _deepstack(item, buffers)
        found[item.mm_hash] = ImageFeatures(frame_tensor(buffers[item.frame], item.dtype, item.shape), item.grid_thw,
                                            span=None if item.span is None else tuple(item.span), deepstack=deepstack,
                                            second_per_grid_t=item.second_per_grid_t)
    return found


def _deepstack(item: GetItem, buffers: list[memoryview]) -> torch.Tensor | None:
    """A found item's DeepStack features: (layers, *shape), both its frame and shape or neither."""
    if item.deepstack_frame is None and item.deepstack_shape is None:
        return None
    shape, main = item.deepstack_shape, item.shape
    if item.deepstack_frame is None or shape is None or main is None or len(shape) != 1 + len(main) \
            or shape[1:] != main:
        raise WireError(f"get_reply item {item.mm_hash[:64]!r}: DeepStack frame {item.deepstack_frame} of shape "
                        f"{shape} does not go with features of shape {main}")
    assert item.dtype is not None  # checked by the caller
    return frame_tensor(buffers[item.deepstack_frame], item.dtype, shape)


def more_of(header: GetReply) -> list[str]:
    """Hashes a `get_reply` left out for its byte limit (held, but to be asked for again)."""
    return [item.mm_hash for item in header.items if not item.found and item.more]
