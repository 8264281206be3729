"""Decoder side of the connector: gathers embeddings from producers into a local cache."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from connector.control.client import ProducerClient, expect
from connector.control.security import CurveConfig
from connector.control.wire import MAX_TENSOR_BYTES, WireError
from connector.tensors.cache import EmbeddingCache
from connector.tensors.errors import InvalidEmbeddings, MissingEmbeddings
from connector.tensors.replies import more_of, read_get_reply
from connector.tensors.shm import ShmError, probed_pid
from connector.tensors.shm_peers import ShmPeers
from epd_common.tracing import traceparent
from epd_contracts.ec import GetReply, GetRequest, ShmProbe, ShmProbeReply, SnapshotReply
from epd_contracts.embeddings import ImageFeatures

logger = logging.getLogger("epd.connector")

_WAIT_MARGIN_S = 0.2  # a waiting producer answers this long before the consumer gives up
MAX_REPLY_BYTES = MAX_TENSOR_BYTES  # default cap on the tensor bytes of one get_reply (at least one item)
MAX_ITEMS_PER_GET = 256  # default: a gather asks one producer for at most this many items per get
_PROBE_TIMEOUT_S = 2.0  # a producer that does not answer a shared-memory probe in this long is asked by socket

Check = Callable[[ImageFeatures], "str | None"]  # a reason to refuse a received item, or None to keep it
Received = dict[str, int]  # transport ("shm", "socket") -> bytes one gather fetched by it


class ECConsumer:
    """Fetches embeddings by mm_hash from the producers that computed them."""

    def __init__(self, cache_bytes: int = 1 << 30, max_message_bytes: int = MAX_TENSOR_BYTES,
                 curve: CurveConfig | None = None, check: Check | None = None,
                 max_reply_bytes: int = MAX_REPLY_BYTES, max_items_per_get: int = MAX_ITEMS_PER_GET,
                 shm: bool = True) -> None:
        """`max_message_bytes` bounds each tensor frame (libzmq drops a peer sending a bigger part);
        `max_reply_bytes` bounds the tensor bytes of one reply (checked before any tensor is built);
        `check` judges every fetched item before it is cached (see gather);
        `shm`: map the items of same-host producers that pass a probe (connector/tensors/shm.py); False: socket only.

        Mapped items count against `cache_bytes` like received ones; a mapping is released when the cache evicts
        its item and no caller holds its tensors (the producer's pages live until then, even if it evicted them)."""
        if max_items_per_get < 1 or max_reply_bytes < 0:
            raise ValueError("max_items_per_get must be >= 1 and max_reply_bytes >= 0")
        self.max_message_bytes = max_message_bytes
        self.max_reply_bytes, self.max_items_per_get = max_reply_bytes, max_items_per_get
        self._check = check
        self._cache: EmbeddingCache[ImageFeatures] = EmbeddingCache(cache_bytes)
        self._client = ProducerClient(curve, max_message_bytes, max_reply_bytes)
        self._peers = ShmPeers(shm)
        self._stats_lock = threading.Lock()
        self._bytes_received = 0
        self._num_shm_items = self._num_shm_bytes = self._num_socket_items = self._num_socket_bytes = 0
        self._num_shm_fallbacks = self._num_shm_probes = 0
        self._num_gathers = 0
        self._num_remote_fetches = 0
        self._num_refused = 0

    def gather(self, mm_hashes: list[str], sources: dict[str, str], timeout: float = 10.0,
               wait_for: Collection[str] = (), received: Received | None = None) -> dict[str, ImageFeatures]:
        """Return every requested item, from the local cache or its source producer (mm_hash -> address).

        Items in `wait_for` may still be encoding: their producer holds the reply until they are stored
        (pipelined gather), for at most `timeout` seconds.

        Every fetched item is passed to the consumer's `check`; an item it refuses is not cached, and once
        the good ones are cached gather raises InvalidEmbeddings({mm_hash: reason}).

        `received`: the bytes fetched are added to it by transport, "shm" (mapped) and "socket" (frames).
        """
        if len(mm_hashes) == 1 and not wait_for:
            one = self._gather_one(mm_hashes[0], sources.get(mm_hashes[0]), timeout, received)
            if one is not None:
                return one
        wanted = list(dict.fromkeys(mm_hashes))
        result = self._cache.pin(wanted)  # what is here stays here until this gather returns
        try:
            remote: dict[str, list[str]] = {}  # producer address -> hashes to fetch there
            for h in wanted:
                if h not in result and h in sources:
                    remote.setdefault(sources[h], []).append(h)
            fetched = self._fetch(remote, timeout, set(wait_for), received) if remote else {}
            return self._gathered(result, fetched, wanted)
        finally:
            self._cache.unpin(wanted)

    def _gather_one(self, mm_hash: str, address: str | None, timeout: float,
                    received: Received | None) -> dict[str, ImageFeatures] | None:
        """The common gather, one item from one producer, inlined (same checks, counters and errors as the general
        path); None to take the general path: a producer to probe first, or a handle that failed to map."""
        wanted = [mm_hash]
        held = self._cache.pin(wanted)
        try:
            if held or address is None:
                return self._gathered(held, {}, wanted)
            if self._peers.enabled and self._peers.to_probe((address,)):
                return None
            pid = self._peers.pid(address)
            request = GetRequest(req_id=self._client.next_req_id(), hashes=wanted, shm=pid is not None,
                                 traceparent=traceparent())
            with self._stats_lock:
                self._num_remote_fetches += 1
            reply = self._client.exchange_one(address, request, timeout)
            fetched: dict[str, ImageFeatures] = {}
            try:
                header = expect(reply, GetReply, address)
                items, unmapped = read_get_reply(header, reply[1] if reply else [], pid, self.max_message_bytes)
            except WireError as e:
                logger.warning("bad get_reply from %s: %s", address, e)
            else:
                if mm_hash in unmapped:  # asked again by socket, on the general path
                    self._peers.failed(address, unmapped[mm_hash])
                    with self._stats_lock:
                        self._num_shm_fallbacks += 1
                    return None
                if mm_hash in items:
                    fetched[mm_hash] = items[mm_hash]
                    self._count(header, fetched, 0, received)
            return self._gathered(held, fetched, wanted)
        finally:
            self._cache.unpin(wanted)

    def _gathered(self, result: dict[str, ImageFeatures], fetched: dict[str, ImageFeatures],
                  wanted: list[str]) -> dict[str, ImageFeatures]:
        """Check and cache what was fetched, count the gather, and return every wanted item (or raise)."""
        refused = self._refused(fetched)
        for h, features in fetched.items():
            if h not in refused:
                self._cache.put(h, features)
                result[h] = features
        with self._stats_lock:
            self._num_gathers += 1
            self._num_refused += len(refused)
            self._bytes_received += sum(features.nbytes for features in fetched.values())
        if refused:
            raise InvalidEmbeddings(refused)
        missing = [h for h in wanted if h not in result]
        if missing:
            raise MissingEmbeddings(missing)
        return {h: result[h] for h in wanted}

    def _refused(self, fetched: dict[str, ImageFeatures]) -> dict[str, str]:
        """mm_hash -> reason, for the fetched items the check refuses (a check that raises refuses too)."""
        if self._check is None:
            return {}
        refused: dict[str, str] = {}
        for h, features in fetched.items():
            try:
                reason = self._check(features)
            except Exception as e:  # noqa: BLE001 - a failing check refuses the item, never the gather
                reason = f"check failed: {type(e).__name__}: {e}"
            if reason is not None:
                refused[h] = reason
        return refused

    def has_cache_item(self, mm_hash: str) -> bool:
        """Whether the item is in the local cache (no network)."""
        return mm_hash in self._cache

    def query(self, address: str, mm_hashes: list[str], timeout: float = 2.0) -> list[bool]:
        """Ask one producer which items it holds; all False if it does not answer in time."""
        return self._client.query(address, mm_hashes, timeout)

    def snapshot(self, address: str, timeout: float = 2.0) -> SnapshotReply | None:
        """Everything one producer holds (epoch, seq, hashes), or None if it does not answer in time."""
        return self._client.snapshot(address, timeout)

    def ping(self, address: str, timeout: float = 2.0) -> bool:
        """Whether a producer answers a ping in time."""
        return self._client.ping(address, timeout)

    def stats(self) -> dict[str, Any]:
        """Cache counters plus fetch counters."""
        with self._stats_lock:
            counters = {
                "bytes_received": self._bytes_received,
                "gathers": self._num_gathers,
                "remote_fetches": self._num_remote_fetches,
                "refused": self._num_refused,
                "shm_items_received": self._num_shm_items,
                "shm_bytes_received": self._num_shm_bytes,
                "socket_items_received": self._num_socket_items,
                "socket_bytes_received": self._num_socket_bytes,
                "shm_fallbacks": self._num_shm_fallbacks,
                "shm_probes": self._num_shm_probes,
                "shm_producers": self._peers.num_mapped(),
            }
        return {**self._cache.stats(), **counters}

    def close(self) -> None:
        """Close every idle producer socket; the consumer cannot be used afterwards."""
        self._client.close()

    def _fetch(self, remote: dict[str, list[str]], timeout: float, wait_for: set[str],
               received: Received | None) -> dict[str, ImageFeatures]:
        """Send one `get` per producer at once (in rounds of max_items_per_get), keeping the items each was asked for."""
        deadline = time.monotonic() + timeout
        fetched: dict[str, ImageFeatures] = {}
        todo = {addr: list(hashes) for addr, hashes in remote.items()}
        if probe := self._peers.to_probe(todo):
            self._probe(probe, min(timeout, _PROBE_TIMEOUT_S))
        n = self.max_items_per_get
        while todo and (remaining_s := deadline - time.monotonic()) > 0:
            chunks = {addr: hashes[:n] for addr, hashes in todo.items()}
            got, more = self._fetch_round(chunks, remaining_s, wait_for, received)
            fetched.update(got)
            # NOTE: a producer answers at least one held item per get, so `more` shrinks every round
            todo = {addr: more.get(addr, []) + hashes[n:] for addr, hashes in todo.items()}
            todo = {addr: hashes for addr, hashes in todo.items() if hashes}
        return fetched

    def _fetch_round(self, remote: dict[str, list[str]], timeout: float, wait_for: set[str],
                     received: Received | None) -> tuple[dict[str, ImageFeatures], dict[str, list[str]]]:
        """One get per producer; returns the items kept and, per producer, those it left out for its byte limit."""
        wait_ms = max(0, int((timeout - _WAIT_MARGIN_S) * 1000))
        pids = {addr: self._peers.pid(addr) for addr in remote}
        requests = {addr: self._get_request(hashes, wait_for, wait_ms, pids[addr] is not None)
                    for addr, hashes in remote.items()}
        with self._stats_lock:
            self._num_remote_fetches += len(requests)
        replies = self._client.exchange(dict(requests), timeout)
        fetched: dict[str, ImageFeatures] = {}
        more: dict[str, list[str]] = {}
        for addr, reply in replies.items():
            try:
                header = expect(reply, GetReply, addr)
                items, unmapped = read_get_reply(header, reply[1], pids[addr], self.max_message_bytes)
            except WireError as e:
                logger.warning("bad get_reply from %s: %s", addr, e)
                continue
            asked = set(remote[addr])
            got = {h: items[h] for h in remote[addr] if h in items}
            fetched.update(got)
            self._count(header, got, len(unmapped), received)
            retry = [h for h in unmapped if h in asked]
            if unmapped:  # asked again by socket in the next round of this gather
                self._peers.failed(addr, next(iter(unmapped.values())))
            if items or retry:  # no progress, no second round: a producer that sends nothing is not asked again
                more[addr] = retry + [h for h in dict.fromkeys(more_of(header)) if h in asked and h not in items]
        return fetched, more

    def _count(self, header: GetReply, got: dict[str, ImageFeatures], num_unmapped: int,
               received: Received | None) -> None:
        """Items and bytes received by socket and by shared memory."""
        mapped = [got[item.mm_hash].nbytes for item in header.items if item.shm is not None and item.mm_hash in got]
        total = sum(features.nbytes for features in got.values())
        if received is not None:
            received["shm"] = received.get("shm", 0) + sum(mapped)
            received["socket"] = received.get("socket", 0) + total - sum(mapped)
        with self._stats_lock:
            self._num_shm_items += len(mapped)
            self._num_shm_bytes += sum(mapped)
            self._num_socket_items += len(got) - len(mapped)
            self._num_socket_bytes += total - sum(mapped)
            self._num_shm_fallbacks += num_unmapped

    def _probe(self, addresses: list[str], timeout: float) -> None:
        """Ask each producer for its probe segment and try to map it: only a producer that passes gets `shm` gets."""
        replies = self._client.exchange({a: ShmProbe(req_id=self._client.next_req_id()) for a in addresses}, timeout)
        with self._stats_lock:
            self._num_shm_probes += len(addresses)
        for addr in addresses:
            try:
                pid = probed_pid(expect(replies.get(addr), ShmProbeReply, addr).handle)
            except (WireError, ShmError) as e:
                self._peers.failed(addr, str(e))
            else:
                self._peers.verified(addr, pid)

    def _get_request(self, hashes: list[str], wait_for: set[str], wait_ms: int, shm: bool) -> GetRequest:
        """A `get`; the hashes in `wait_for` may still be encoding, and the producer may hold the reply for them;
        `shm`: answer held items by shared-memory handle."""
        wait = [h for h in hashes if h in wait_for]
        if not wait or wait_ms <= 0:
            return GetRequest(req_id=self._client.next_req_id(), hashes=hashes, shm=shm, traceparent=traceparent())
        return GetRequest(req_id=self._client.next_req_id(), hashes=hashes, wait=wait, wait_ms=wait_ms, shm=shm,
                          traceparent=traceparent())

