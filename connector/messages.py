"""Headers of the connector ops (get, has, ping) and their replies."""

from __future__ import annotations

from typing import Any

import torch

from connector.types import EncoderOutput
from connector.wire import WireError, tensor_from_frame, tensor_spec


def request(op: str, req_id: int, hashes: list[str] | None = None) -> dict[str, Any]:
    """Header of a request to a producer."""
    header: dict[str, Any] = {"op": op, "req_id": req_id}
    if hashes is not None:
        header["hashes"] = list(hashes)
    return header


def error_reply(req_id: int, message: str) -> dict[str, Any]:
    """Header of a reply to a request the producer could not serve."""
    return {"op": "error", "req_id": req_id, "message": message}


def parse_hashes(header: dict[str, Any]) -> list[str]:
    """Return a request's `hashes`, checking their types."""
    hashes = header.get("hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        raise WireError(f"{header['op']} needs `hashes` as a list of str")
    return hashes


def get_reply(req_id: int, hashes: list[str], found: dict[str, EncoderOutput]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Header and tensor frames answering a `get`: one item per requested hash."""
    items: list[dict[str, Any]] = []
    tensors: list[torch.Tensor] = []
    for mm_hash in hashes:
        out = found.get(mm_hash)
        if out is None:
            items.append({"mm_hash": mm_hash, "found": False})
            continue
        spec = tensor_spec(out.embeds, frame=len(tensors))
        grid = list(out.grid_thw) if out.grid_thw is not None else None
        items.append({"mm_hash": mm_hash, "found": True, "num_tokens": out.num_tokens, "grid_thw": grid, **spec})
        tensors.append(out.embeds)
    return {"op": "get_reply", "req_id": req_id, "items": items}, tensors


def parse_get_reply(header: dict[str, Any], buffers: list[memoryview]) -> dict[str, EncoderOutput]:
    """Return the found items of a decoded `get_reply`, keyed by mm_hash."""
    found: dict[str, EncoderOutput] = {}
    for item in header.get("items", []):
        mm_hash = item.get("mm_hash")
        if not isinstance(mm_hash, str):
            raise WireError(f"get_reply item has a non-str mm_hash {mm_hash!r}")
        if item.get("found") is not True:
            continue
        if "frame" not in item:
            raise WireError(f"get_reply item {mm_hash!r} is found but has no tensor frame")
        embeds = tensor_from_frame(buffers[item["frame"]], item.get("dtype"), item.get("shape"))
        found[mm_hash] = _output(mm_hash, embeds, item)
    return found


def parse_has_reply(header: dict[str, Any], num_hashes: int) -> list[bool]:
    """Return the flags of a `has_reply`, checking there is one bool per asked hash."""
    flags = header.get("has")
    if not isinstance(flags, list) or len(flags) != num_hashes or not all(isinstance(f, bool) for f in flags):
        raise WireError(f"has_reply needs `has` as a list of {num_hashes} bool(s), got {flags!r}")
    return flags


def _output(mm_hash: str, embeds: torch.Tensor, item: dict[str, Any]) -> EncoderOutput:
    if embeds.dim() < 1 or item.get("num_tokens") != embeds.shape[0]:
        raise WireError(f"get_reply item {mm_hash!r}: num_tokens does not match shape {list(embeds.shape)}")
    grid = item.get("grid_thw")
    if grid is None:
        return EncoderOutput(mm_hash, embeds, None)
    if not isinstance(grid, list) or len(grid) != 3 or not all(type(v) is int for v in grid):
        raise WireError(f"get_reply item {mm_hash!r}: grid_thw must be 3 ints or nil, got {grid!r}")
    return EncoderOutput(mm_hash, embeds, (grid[0], grid[1], grid[2]))
