"""A producer's answers to `get`: sent at once from the cache (and the tier below), or parked until the items
arrive, fail or time out; counts what it sent. Used by the serving thread only (connector/tensors/server.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from connector.control.wire import WireError, encode_message
from connector.tensors.cache import EmbeddingCache
from connector.tensors.frames import WireItem
from connector.tensors.replies import get_reply
from connector.tensors.waiters import FailedSet, ParkedGet, WaitList
from epd_contracts.ec import MAX_WAIT_MS, GetRequest

_MORE = int(zmq.SNDMORE)
_MAX_REQ_ID = 1 << 64  # req_ids a pre-encoded reply header can carry (msgpack uint64)


def check_count(hashes: list[str], op: str, limit: int) -> list[str]:
    if len(hashes) > limit:
        raise WireError(f"{op} asks for {len(hashes)} hashes, over the {limit}-item limit")
    return hashes


class GetAnswers:
    """Answers gets on the serving thread's ROUTER (`router`, set once it is bound).

    `lower`: an item the memory cache lacks, from the tier below (the disk), or None. `on_gathered`: told the
    hashes every get reply carried. `shm`: shared memory is on (a get that asks for it is answered by handle)."""

    def __init__(self, cache: EmbeddingCache[WireItem], *, max_items_per_get: int, max_reply_bytes: int,
                 max_parked_gets: int, max_parked_hashes: int, shm: bool,
                 lower: Callable[[str], WireItem | None] | None,
                 on_gathered: Callable[[list[str]], None] | None) -> None:
        self._cache, self._lower, self._on_gathered, self._shm = cache, lower, on_gathered, shm
        self.max_items_per_get, self.max_reply_bytes = max_items_per_get, max_reply_bytes
        self.router: zmq.Socket[Any] | None = None
        self.waits = WaitList(max_parked_gets, max_parked_hashes)
        self.failed = FailedSet()
        self._num_gets_served = self._num_gets_waited = self._bytes_sent = 0
        self._num_shm_items = self._num_shm_bytes = self._num_socket_items = 0

    def stats(self) -> dict[str, Any]:
        return {
            "gets_served": self._num_gets_served,
            "gets_waited": self._num_gets_waited,
            "gets_waiting": len(self.waits),
            "hashes_waiting": self.waits.num_hashes,
            "bytes_sent": self._bytes_sent,
            "socket_items_served": self._num_socket_items,
            "socket_bytes_served": self._bytes_sent,
            "shm_items_served": self._num_shm_items,
            "shm_bytes_served": self._num_shm_bytes,
        }

    def get(self, identity: bytes, header: GetRequest) -> None:
        """Answer now, or park the get when it may wait for items still being encoded."""
        req_id, hashes = header.req_id, check_count(header.hashes, "get", self.max_items_per_get)
        if len(hashes) == 1 and not header.wait and 0 <= req_id < _MAX_REQ_ID and self._one(identity, header):
            return
        wait, wait_ms = set(header.wait), min(header.wait_ms, MAX_WAIT_MS)
        if not wait <= set(hashes):
            raise WireError("get `wait` must be a list of hashes the get asks for")
        keys = list(dict.fromkeys(hashes))
        found = self._pin(keys)
        try:
            missing = {h for h in keys if h not in found and h not in self.failed and not self._cache.holds(h)}
            if not (missing and missing <= wait and wait_ms > 0 and self.waits.can_park(len(hashes))):
                self._send_reply(identity, req_id, hashes, found, header.shm)
                return
        finally:
            self._cache.unpin(keys)
        self.waits.park(ParkedGet(identity, req_id, hashes, missing, time.monotonic() + wait_ms / 1000, header.shm))
        self._num_gets_waited += 1

    def _one(self, identity: bytes, header: GetRequest) -> bool:
        """The common get (one item, no wait) from its held item's pre-encoded reply; False: answer it in full."""
        hashes = header.hashes
        mm_hash = hashes[0]
        found = self._pin(hashes)
        try:
            held = found.get(mm_hash)
            parts = None if held is None else held.reply_parts(mm_hash, header.shm and self._shm)
            if held is None or parts is None:
                return False
            if self._on_gathered is not None:  # before the send, as the counters: the consumer may look
                self._on_gathered(hashes)
            self._send_one(identity, header.req_id, held, parts)
            return True
        finally:
            self._cache.unpin(hashes)

    def answer(self, get: ParkedGet) -> None:
        """Answer a parked get with whatever is there now."""
        keys = list(dict.fromkeys(get.hashes))
        found = self._pin(keys)
        try:
            self._send_reply(get.identity, get.req_id, get.hashes, found, get.shm)
        finally:
            self._cache.unpin(keys)

    def settle(self, settled: list[str]) -> None:
        """`settled` were stored or failed: answer the parked gets that waited for nothing else."""
        for get in self.waits.resolve(settled, lambda h: self._cache.holds(h) or h in self.failed):
            self.answer(get)

    def _pin(self, keys: list[str]) -> dict[str, WireItem]:
        """Pin `keys` (distinct; pair with `self._cache.unpin(keys)`) and return those held, the tier below asked
        for what memory lacks, up to one reply's bytes (the rest are answered `more`: held, ask again), so one get
        of many disk items never reads more than it can send."""
        found = self._cache.pin(keys)
        if self._lower is not None and len(found) < len(keys):
            read = 0
            for h in keys:
                if h in found or (read and read >= self.max_reply_bytes):
                    continue
                if (item := self._lower(h)) is not None:
                    found[h] = item
                    read += item.nbytes or 1
        return found

    def _send_one(self, identity: bytes, req_id: int, held: WireItem, parts: tuple[bytes, bytes, bool]) -> None:
        """Send a single found item's reply from its pre-encoded header, the req_id patched in."""
        assert self.router is not None
        prefix, suffix, by_handle = parts
        self._num_gets_served += 1  # before the send: a consumer may read stats() the moment it has the reply
        router = self.router
        router.send(identity, _MORE)
        if by_handle:
            self._num_shm_items += 1
            self._num_shm_bytes += held.nbytes
            router.send(prefix + req_id.to_bytes(8, "big") + suffix, 0)
            return
        tensors = held.buffers
        self._num_socket_items += 1
        self._bytes_sent += sum(buf.nbytes for buf in tensors)
        router.send(prefix + req_id.to_bytes(8, "big") + suffix, _MORE)
        for i, buf in enumerate(tensors, 1):
            router.send(buf, _MORE if i < len(tensors) else 0, copy=False)

    def _send_reply(self, identity: bytes, req_id: int, hashes: list[str], found: dict[str, WireItem],
                    shm: bool = False) -> None:
        """Send a get's reply; the caller keeps the items pinned until ZeroMQ has taken the frames."""
        assert self.router is not None
        later = frozenset(h for h in hashes if h not in found and self._cache.holds(h)) if self._lower else frozenset()
        header, frames = get_reply(req_id, hashes, found, self.failed.frozen(hashes), self.max_reply_bytes,
                                   shm and self._shm, later)
        if self._on_gathered is not None:
            self._on_gathered([item.mm_hash for item in header.items if item.found])
        # before the send: a consumer may read stats() the moment it has the reply
        self._num_gets_served += 1
        self._bytes_sent += sum(buf.nbytes for buf in frames)
        if shm:
            by_handle = [item for item in header.items if item.shm is not None]
            self._num_shm_items += len(by_handle)
            self._num_shm_bytes += sum(found[item.mm_hash].nbytes for item in by_handle)
            self._num_socket_items += sum(1 for item in header.items if item.found and item.shm is None)
        else:
            self._num_socket_items += sum(1 for item in header.items if item.found)
        router, (head, *tensors) = self.router, encode_message(header, frames)
        # NOTE: send part by part: send_multipart adds flag arithmetic per part, costly on a cold cache
        router.send(identity, _MORE)
        router.send(head, _MORE if tensors else 0)
        for i, buf in enumerate(tensors, 1):
            router.send(buf, _MORE if i < len(tensors) else 0, copy=False)
