"""Decoder side of the connector: gathers embeddings from producers into a local cache."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import zmq

from connector import messages
from connector.cache import EmbeddingCache
from connector.channel import ChannelPool, PeerChannel
from connector.security import CurveConfig
from connector.types import EncoderOutput, InvalidEmbeddings, MissingEmbeddings
from connector.wire import (
    MAX_REPLY_HEADER_BYTES,
    MAX_TENSOR_BYTES,
    WireError,
    decode_message,
    encode_message,
    peek_req_id,
)

logger = logging.getLogger("epd.connector")

Reply = tuple[dict[str, Any], list[memoryview]]  # (header, tensor frame buffers)
_WAIT_MARGIN_S = 0.2  # a waiting producer answers this long before the consumer gives up
MAX_REPLY_BYTES = MAX_TENSOR_BYTES  # default cap on the tensor bytes of one get_reply (at least one item)
MAX_ITEMS_PER_GET = 256  # default: a gather asks one producer for at most this many items per get

Check = Callable[[EncoderOutput], "str | None"]  # a reason to refuse a received item, or None to keep it


class ECConsumer:
    """Fetches embeddings by mm_hash from the producers that computed them."""

    def __init__(self, cache_bytes: int = 1 << 30, max_message_bytes: int = MAX_TENSOR_BYTES,
                 curve: CurveConfig | None = None, check: Check | None = None,
                 max_reply_bytes: int = MAX_REPLY_BYTES, max_items_per_get: int = MAX_ITEMS_PER_GET) -> None:
        """`max_message_bytes` bounds each tensor frame (libzmq drops a peer sending a bigger part);
        `max_reply_bytes` bounds the tensor bytes of one reply (checked before any tensor is built);
        `check` judges every fetched item before it is cached (see gather)."""
        if max_items_per_get < 1 or max_reply_bytes < 0:
            raise ValueError("max_items_per_get must be >= 1 and max_reply_bytes >= 0")
        self.max_message_bytes = max_message_bytes
        self.max_reply_bytes, self.max_items_per_get = max_reply_bytes, max_items_per_get
        self._check = check
        self._cache = EmbeddingCache(cache_bytes)
        self._pool = ChannelPool(zmq.Context.instance(), curve, max_message_bytes)
        self._req_ids = itertools.count(1)
        self._stats_lock = threading.Lock()
        self._bytes_received = 0
        self._num_gathers = 0
        self._num_remote_fetches = 0
        self._num_refused = 0

    def gather(self, mm_hashes: list[str], sources: dict[str, str], timeout: float = 10.0,
               wait_for: Collection[str] = ()) -> dict[str, EncoderOutput]:
        """Return every requested item, from the local cache or its source producer (mm_hash -> address).

        Items in `wait_for` may still be encoding: their producer holds the reply until they are stored
        (pipelined gather), for at most `timeout` seconds.

        Every fetched item is passed to the consumer's `check`; an item it refuses is not cached, and once
        the good ones are cached gather raises InvalidEmbeddings({mm_hash: reason}).
        """
        wanted = list(dict.fromkeys(mm_hashes))
        result = self._cache.pin(wanted)  # what is here stays here until this gather returns
        try:
            remote: dict[str, list[str]] = {}  # producer address -> hashes to fetch there
            for h in wanted:
                if h not in result and h in sources:
                    remote.setdefault(sources[h], []).append(h)
            fetched = self._fetch(remote, timeout, set(wait_for)) if remote else {}
            refused = self._refused(fetched)
            for h, out in fetched.items():
                if h not in refused:
                    self._cache.put(out)
                    result[h] = out
        finally:
            self._cache.unpin(wanted)
        with self._stats_lock:
            self._num_gathers += 1
            self._num_refused += len(refused)
            self._bytes_received += sum(out.nbytes for out in fetched.values())
        if refused:
            raise InvalidEmbeddings(refused)
        missing = [h for h in wanted if h not in result]
        if missing:
            raise MissingEmbeddings(missing)
        return {h: result[h] for h in wanted}

    def _refused(self, fetched: dict[str, EncoderOutput]) -> dict[str, str]:
        """mm_hash -> reason, for the fetched items the check refuses (a check that raises refuses too)."""
        if self._check is None:
            return {}
        refused: dict[str, str] = {}
        for h, out in fetched.items():
            try:
                reason = self._check(out)
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
        if not mm_hashes:
            return []
        req = messages.request("has", next(self._req_ids), mm_hashes)
        reply = self._exchange({address: req}, timeout).get(address)
        try:
            return messages.parse_has_reply(self._expect(reply, "has_reply", address), len(mm_hashes))
        except WireError as e:
            logger.warning("bad has_reply from %s: %s", address, e)
            return [False] * len(mm_hashes)

    def snapshot(self, address: str, timeout: float = 2.0) -> tuple[str, int, list[str]] | None:
        """(epoch, seq, held hashes) of one producer, or None if it does not answer in time."""
        reply = self._exchange({address: messages.request("snapshot", next(self._req_ids))}, timeout).get(address)
        try:
            return messages.parse_position(self._expect(reply, "snapshot_reply", address))
        except WireError as e:
            logger.warning("no snapshot from %s: %s", address, e)
            return None

    def ping(self, address: str, timeout: float = 2.0) -> bool:
        """Whether a producer answers a ping in time."""
        reply = self._exchange({address: messages.request("ping", next(self._req_ids))}, timeout).get(address)
        return reply is not None and reply[0]["op"] == "pong"

    def stats(self) -> dict[str, Any]:
        """Cache counters plus fetch counters."""
        with self._stats_lock:
            counters = {
                "bytes_received": self._bytes_received,
                "gathers": self._num_gathers,
                "remote_fetches": self._num_remote_fetches,
                "refused": self._num_refused,
            }
        return {**self._cache.stats(), **counters}

    def close(self) -> None:
        """Close every idle producer socket; the consumer cannot be used afterwards."""
        self._pool.close()

    def _fetch(self, remote: dict[str, list[str]], timeout: float, wait_for: set[str]) -> dict[str, EncoderOutput]:
        """Send one `get` per producer at once (in rounds of max_items_per_get), keeping the items each was asked for."""
        deadline = time.monotonic() + timeout
        fetched: dict[str, EncoderOutput] = {}
        todo = {addr: list(hashes) for addr, hashes in remote.items()}
        n = self.max_items_per_get
        while todo and (remaining_s := deadline - time.monotonic()) > 0:
            chunks = {addr: hashes[:n] for addr, hashes in todo.items()}
            got, more = self._fetch_round(chunks, remaining_s, wait_for)
            fetched.update(got)
            # NOTE: a producer answers at least one held item per get, so `more` shrinks every round
            todo = {addr: more.get(addr, []) + hashes[n:] for addr, hashes in todo.items()}
            todo = {addr: hashes for addr, hashes in todo.items() if hashes}
        return fetched

    def _fetch_round(self, remote: dict[str, list[str]], timeout: float,
                     wait_for: set[str]) -> tuple[dict[str, EncoderOutput], dict[str, list[str]]]:
        """One get per producer; returns the items kept and, per producer, those it left out for its byte limit."""
        wait_ms = max(0, int((timeout - _WAIT_MARGIN_S) * 1000))
        requests = {addr: messages.get_request(next(self._req_ids), hashes, [h for h in hashes if h in wait_for],
                                               wait_ms) for addr, hashes in remote.items()}
        with self._stats_lock:
            self._num_remote_fetches += len(requests)
        replies = self._exchange(requests, timeout)
        fetched: dict[str, EncoderOutput] = {}
        more: dict[str, list[str]] = {}
        for addr, reply in replies.items():
            try:
                header = self._expect(reply, "get_reply", addr)
                items = messages.parse_get_reply(header, reply[1])
            except WireError as e:
                logger.warning("bad get_reply from %s: %s", addr, e)
                continue
            asked = set(remote[addr])
            fetched.update({h: items[h] for h in remote[addr] if h in items})
            if items:  # no progress, no second round: a producer that sends nothing is not asked again
                more[addr] = [h for h in dict.fromkeys(messages.more_of(header)) if h in asked and h not in items]
        return fetched, more

    def _expect(self, reply: Reply | None, op: str, address: str) -> dict[str, Any]:
        if reply is None:
            raise WireError(f"no reply from {address}")
        header = reply[0]
        if header["op"] == "error":
            raise WireError(f"producer error: {header.get('message')!r}")
        if header["op"] != op:
            raise WireError(f"expected {op}, got {header['op']!r}")
        return header

    def _exchange(self, requests: dict[str, dict[str, Any]], timeout: float) -> dict[str, Reply]:
        """Send each request to its producer, then collect replies until `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        channels = [self._pool.checkout(addr) for addr in requests]
        try:
            pending: dict[zmq.Socket[Any], tuple[PeerChannel, int]] = {}  # socket -> (channel, req_id)
            for channel in channels:
                req = requests[channel.address]
                if channel.send(encode_message(req)):
                    pending[channel.socket()] = (channel, req["req_id"])
            replies = self._collect(pending, deadline)
            for channel, _ in pending.values():
                # NOTE: a timed-out socket may still get the late reply; a fresh one never will.
                channel.reset()
        finally:
            for channel in channels:
                self._pool.checkin(channel)
        return replies

    def _collect(self, pending: dict[zmq.Socket[Any], tuple[PeerChannel, int]], deadline: float) -> dict[str, Reply]:
        """Read replies into a dict (address -> reply), removing answered sockets from `pending`."""
        replies: dict[str, Reply] = {}
        if len(pending) == 1:  # the common case: one producer; a blocking receive with a timeout, no poll
            (sock, (channel, req_id)), = pending.items()
            while (remaining_s := deadline - time.monotonic()) > 0:
                channel.set_rcvtimeo(math.ceil(remaining_s * 1000))
                try:
                    reply = self._read(sock, channel.address, req_id)
                except zmq.Again:
                    break
                if reply is not None:
                    replies[channel.address] = reply
                    del pending[sock]
                    break
            return replies
        poller = zmq.Poller()
        for sock in pending:
            poller.register(sock, zmq.POLLIN)
        while pending and (remaining_s := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(math.ceil(remaining_s * 1000)):
                channel, req_id = pending[sock]
                reply = self._read(sock, channel.address, req_id)
                if reply is not None:
                    replies[channel.address] = reply
                    del pending[sock]
                    poller.unregister(sock)
        return replies

    def _read(self, sock: zmq.Socket[Any], address: str, req_id: int) -> Reply | None:
        """Decode one reply; None for a malformed one or a stale one of an earlier request."""
        frames = sock.recv_multipart(copy=False)
        try:
            header, buffers = decode_message(frames, self.max_message_bytes, MAX_REPLY_HEADER_BYTES)
        except WireError as e:
            logger.warning("malformed reply from %s: %s", address, e)
            if peek_req_id(frames) == req_id:  # the answer to this request, unusable: fail now, not at the timeout
                return {"op": "error", "req_id": req_id, "message": f"malformed reply: {e}"}, []
            return None
        if header["req_id"] != req_id:
            logger.debug("discarding stale reply %s from %s", header["req_id"], address)
            return None
        total = sum(buf.nbytes for buf in buffers)
        if total > self.max_reply_bytes:  # refused before any tensor is built; the frames are freed on return
            logger.warning("refusing a reply of %d tensor bytes from %s (over the %d-byte cap)", total, address,
                           self.max_reply_bytes)
            return {"op": "error", "req_id": req_id, "message": f"reply of {total} bytes over the consumer cap"}, []
        return header, buffers
