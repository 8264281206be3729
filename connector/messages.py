"""Headers of the connector ops (get, has, ping, snapshot), their replies, and published events."""

from __future__ import annotations

import reprlib
from typing import Any

import torch

from connector.types import EncoderOutput
from connector.wire import WireError, frame_tensor

MAX_WAIT_MS = 60_000  # the longest a producer holds a `get` for items still encoding
MAX_HASH_LEN = 256  # characters of one mm_hash on the wire (real ones are 64)
EVENT_KINDS = frozenset({"stored", "evicted", "heartbeat"})


def request(op: str, req_id: int, hashes: list[str] | None = None) -> dict[str, Any]:
    """Header of a request to a producer."""
    header: dict[str, Any] = {"op": op, "req_id": req_id}
    if hashes is not None:
        header["hashes"] = list(hashes)
    return header


def get_request(req_id: int, hashes: list[str], wait: list[str] | None = None, wait_ms: int = 0) -> dict[str, Any]:
    """A `get`; items in `wait` may still be encoding, and the producer holds the reply up to `wait_ms` for them."""
    header = request("get", req_id, hashes)
    if wait and wait_ms > 0:
        header.update(wait=list(wait), wait_ms=int(wait_ms))
    return header


def parse_wait(header: dict[str, Any], hashes: list[str]) -> tuple[set[str], int]:
    """A `get`'s wait list (a subset of its hashes) and wait in ms, capped at MAX_WAIT_MS."""
    if "wait" not in header and "wait_ms" not in header:
        return set(), 0  # the common case: nothing may wait
    wait, wait_ms = header.get("wait", []), header.get("wait_ms", 0)
    if not isinstance(wait, list) or not all(isinstance(h, str) for h in wait) or not set(wait) <= set(hashes):
        raise WireError("get `wait` must be a list of hashes the get asks for")
    if not isinstance(wait_ms, int) or isinstance(wait_ms, bool) or wait_ms < 0:
        raise WireError(f"get `wait_ms` must be a non-negative int, got {reprlib.repr(wait_ms)}")
    return set(wait), min(wait_ms, MAX_WAIT_MS)


def snapshot_reply(req_id: int, epoch: str, seq: int, hashes: list[str]) -> dict[str, Any]:
    """Everything a producer holds, as of event `seq` of `epoch`."""
    return {"op": "snapshot_reply", "req_id": req_id, "epoch": epoch, "seq": seq, "hashes": hashes}


def event(producer: str, epoch: str, seq: int, kind: str, hashes: list[str]) -> dict[str, Any]:
    """A published cache event; `heartbeat` repeats the last seq and carries no hashes."""
    return {"op": "event", "req_id": 0, "producer": producer, "epoch": epoch, "seq": seq, "kind": kind,
            "hashes": hashes}


def parse_position(header: dict[str, Any]) -> tuple[str, int, list[str]]:
    """(epoch, seq, hashes) of a snapshot reply or an event, checking their types."""
    epoch, seq = header.get("epoch"), header.get("seq")
    if not isinstance(epoch, str) or not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise WireError(f"{header['op']} needs a str epoch and a non-negative int seq")
    return epoch, seq, parse_hashes(header)


def error_reply(req_id: int, message: str) -> dict[str, Any]:
    """Header of a reply to a request the producer could not serve."""
    return {"op": "error", "req_id": req_id, "message": message}


def parse_hashes(header: dict[str, Any], max_items: int | None = None) -> list[str]:
    """Return a request's `hashes`, checking their types, lengths and (with max_items) count."""
    hashes = header.get("hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, str) and len(h) <= MAX_HASH_LEN for h in hashes):
        raise WireError(f"{header['op']} needs `hashes` as a list of str of at most {MAX_HASH_LEN} characters")
    if max_items is not None and len(hashes) > max_items:
        raise WireError(f"{header['op']} asks for {len(hashes)} hashes, over the {max_items}-item limit")
    return hashes


def get_reply(req_id: int, hashes: list[str], found: dict[str, EncoderOutput],
              failed: frozenset[str] = frozenset(), max_bytes: int | None = None) -> tuple[dict[str, Any], list[memoryview]]:
    """Header and tensor frames answering a `get`: one item per requested hash (`failed`: encoding failed).

    With `max_bytes`, found items past that many tensor bytes are left out with `more: true` (ask again);
    the first found item always goes (each is bounded by the frame limit).
    """
    items: list[dict[str, Any]] = []
    frames: list[memoryview] = []
    total = 0
    for mm_hash in hashes:
        out = found.get(mm_hash)
        if out is None:
            items.append({"mm_hash": mm_hash, "found": False, "failed": mm_hash in failed})
            continue
        if max_bytes is not None and frames and total + out.nbytes > max_bytes:
            items.append({"mm_hash": mm_hash, "found": False, "more": True})
            continue
        total += out.nbytes
        items.append({"mm_hash": mm_hash, "found": True, **out.wire_spec, "frame": len(frames)})
        frames.append(out.wire_buffer)
    return {"op": "get_reply", "req_id": req_id, "items": items}, frames


def parse_get_reply(header: dict[str, Any], buffers: list[memoryview]) -> dict[str, EncoderOutput]:
    """Return the found items of a decoded `get_reply`, keyed by mm_hash."""
    found: dict[str, EncoderOutput] = {}
    for item in header.get("items", []):
        mm_hash = item.get("mm_hash")
        if not isinstance(mm_hash, str):
            raise WireError(f"get_reply item has a non-str mm_hash {reprlib.repr(mm_hash)}")
        if item.get("found") is not True:
            continue
        if "frame" not in item:
            raise WireError(f"get_reply item {reprlib.repr(mm_hash)} is found but has no tensor frame")
        embeds = frame_tensor(buffers[item["frame"]], item["dtype"], item["shape"])  # decode_message checked them
        found[mm_hash] = _output(mm_hash, embeds, item)
    return found


def more_of(header: dict[str, Any]) -> list[str]:
    """Hashes a `get_reply` left out for its byte limit (held, but to be asked for again)."""
    return [i["mm_hash"] for i in header.get("items", [])
            if isinstance(i.get("mm_hash"), str) and i.get("found") is not True and i.get("more") is True]


def parse_has_reply(header: dict[str, Any], num_hashes: int) -> list[bool]:
    """Return the flags of a `has_reply`, checking there is one bool per asked hash."""
    flags = header.get("has")
    if not isinstance(flags, list) or len(flags) != num_hashes or not all(isinstance(f, bool) for f in flags):
        raise WireError(f"has_reply needs `has` as a list of {num_hashes} bool(s), got {reprlib.repr(flags)}")
    return flags


def _output(mm_hash: str, embeds: torch.Tensor, item: dict[str, Any]) -> EncoderOutput:
    shape = item["shape"]  # decode_message checked it: a list of ints
    if not shape or item.get("num_tokens") != shape[0]:
        raise WireError(f"get_reply item {reprlib.repr(mm_hash)}: num_tokens does not match shape {shape}")
    grid = item.get("grid_thw")
    if grid is None:
        return EncoderOutput(mm_hash, embeds, None)
    if not isinstance(grid, list) or len(grid) != 3 or not all(type(v) is int for v in grid):
        raise WireError(f"get_reply item {reprlib.repr(mm_hash)}: grid_thw must be 3 ints or nil, got {reprlib.repr(grid)}")
    return EncoderOutput(mm_hash, embeds, (grid[0], grid[1], grid[2]))
