"""A producer's serving thread: ROUTER for `get`/`has`/`ping`/`snapshot`, PUB for cache events, parked gets."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from connector.control.endpoints import advertised
from connector.control.security import CurveConfig, secure_server, start_authenticator
from connector.control.waker import Waker
from connector.control.wire import WireError, apply_socket_limits, decode_message, encode_message, peek_req_id
from connector.tensors.cache import EmbeddingCache
from connector.tensors.frames import WireItem
from connector.tensors.replies import get_reply
from connector.tensors.shm import Segment
from connector.tensors.waiters import FailedSet, ParkedGet, WaitList
from epd_common.tracing import span
from epd_contracts.ec import (
    HEARTBEAT_S,
    MAX_WAIT_MS,
    CacheEvent,
    ErrorReply,
    EventKind,
    GetRequest,
    HasReply,
    HasRequest,
    Message,
    PingRequest,
    Pong,
    ShmProbe,
    ShmProbeReply,
    SnapshotReply,
    SnapshotRequest,
)

logger = logging.getLogger("epd.connector")

_START_TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 1 << 20  # requests carry hashes only
_MORE = int(zmq.SNDMORE)
_BATCH = 64  # requests served per wake-up before timers are checked again
_MAX_REQ_ID = 1 << 64  # req_ids a pre-encoded reply header can carry (msgpack uint64)


class ProducerServer:
    """Serves one producer's cache: answers requests, parks gets for items still being encoded, publishes events.

    Other threads only `wake()` it, report failures (`mark_failed`) and read `stats()`; the serving thread is
    the only user of the sockets and of the wait list.
    """

    def __init__(self, cache: EmbeddingCache[WireItem], epoch: str, *, bind: str, events_bind: str,
                 curve: CurveConfig | None, advertise_host: str | None, max_message_bytes: int,
                 max_items_per_get: int, max_reply_bytes: int, max_parked_gets: int, max_parked_hashes: int,
                 shm_probe: Segment | None = None, lower: Callable[[str], WireItem | None] | None = None,
                 on_gathered: Callable[[list[str]], None] | None = None) -> None:
        """`shm_probe`: the segment a ShmProbe is answered with (None: shared memory off or unavailable).
        `lower`: an item the memory cache lacks, from the tier below (the disk), or None. `on_gathered`: told the
        hashes every get reply carried, and those evicted (neither is waiting to be gathered any more)."""
        self._lower, self._on_gathered = lower, on_gathered
        self.bind, self.events_bind, self.curve, self.advertise_host = bind, events_bind, curve, advertise_host
        self.max_message_bytes, self.max_items_per_get, self.max_reply_bytes = (
            max_message_bytes, max_items_per_get, max_reply_bytes)
        self.epoch = epoch
        self._cache = cache
        self._shm_probe = shm_probe
        # NOTE: a ZAP authenticator is per context, so a producer that checks client keys has its own.
        self._ctx: zmq.Context[Any] = zmq.Context() if curve and curve.allowed_clients else zmq.Context.instance()
        self.address: str | None = None
        self.events_address: str | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._waker = Waker()
        self._failed_inbox: collections.deque[str] = collections.deque()
        # Serving-thread state.
        self._router: zmq.Socket[Any] | None = None
        self._waits = WaitList(max_parked_gets, max_parked_hashes)
        self._failed = FailedSet()
        self._published_seq = 0
        self._num_gets_served = 0
        self._num_gets_waited = 0
        self._bytes_sent = 0
        self._num_shm_items = self._num_shm_bytes = self._num_socket_items = 0
        self._num_shm_probes = 0
        self._num_bad_messages = 0
        self._num_events = 0

    def start(self) -> None:
        """Bind the sockets in a daemon thread and wait until they are listening."""
        assert self._thread is None, "ECProducer already started"
        self._thread = threading.Thread(target=self._serve, name="epd-ec-producer", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise TimeoutError(f"producer did not bind {self.bind} within {_START_TIMEOUT_S}s")
        if self._start_error is not None:
            self._thread.join(timeout=5)
            self._thread = None
            self._waker.close()
            raise self._start_error

    def wake(self) -> None:
        """New items may be in the cache: publish their events and answer the gets waiting for them."""
        self._waker.wake()

    def mark_failed(self, mm_hashes: list[str]) -> None:
        self._failed_inbox.extend(mm_hashes)
        self._waker.wake()

    def stats(self) -> dict[str, Any]:
        return {
            "gets_served": self._num_gets_served,
            "gets_waited": self._num_gets_waited,
            "gets_waiting": len(self._waits),
            "hashes_waiting": self._waits.num_hashes,
            "bytes_sent": self._bytes_sent,
            "socket_items_served": self._num_socket_items,
            "socket_bytes_served": self._bytes_sent,
            "shm_items_served": self._num_shm_items,
            "shm_bytes_served": self._num_shm_bytes,
            "shm_probes": self._num_shm_probes,
            "bad_messages": self._num_bad_messages,
            "events_published": self._num_events,
        }

    def close(self) -> None:
        """Stop the serving thread (it closes its own sockets), then the wake pipe."""
        if self._thread is not None:
            self._stop.set()
            self._waker.wake()
            self._thread.join(timeout=5)
            self._thread = None
        self._waker.close()

    # serving thread

    def _serve(self) -> None:
        auth = start_authenticator(self._ctx, self.curve)
        router, pub = self._ctx.socket(zmq.ROUTER), self._ctx.socket(zmq.PUB)
        for sock in (router, pub):
            sock.setsockopt(zmq.LINGER, 0)
            secure_server(sock, self.curve)
        apply_socket_limits(router, MAX_REQUEST_BYTES)
        pub.setsockopt(zmq.SNDHWM, 100_000)  # a slow subscriber loses events past this and resyncs
        try:
            router.bind(self.bind)
            pub.bind(self.events_bind)
            self.address = advertised(router.getsockopt_string(zmq.LAST_ENDPOINT), self.advertise_host)
            self.events_address = advertised(pub.getsockopt_string(zmq.LAST_ENDPOINT), self.advertise_host)
        except zmq.ZMQError as e:
            self._start_error = e
        self._ready.set()
        try:
            if self._start_error is None:
                self._router = router
                self._loop(router, pub)
        finally:
            router.close()
            pub.close()
            if auth is not None:
                auth.stop()
            if self._ctx is not zmq.Context.instance():
                self._ctx.term()

    def _loop(self, router: zmq.Socket[Any], pub: zmq.Socket[Any]) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        next_beat = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._publish(pub, self._event(self._published_seq, "heartbeat", []))
                next_beat = now + HEARTBEAT_S
            deadline = next_beat
            if self._waits:  # nothing parked (the common case): no timers but the heartbeat
                for get in self._waits.expired(now):
                    self._answer(get)
                deadline = min(next_beat, self._waits.next_deadline() or next_beat)
            events = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000) + 1)))
            if self._waker.fileno() in events:
                self._waker.drain()
                self._settle(pub)
            if router in events:
                self._serve_pending(router)

    def _serve_pending(self, router: zmq.Socket[Any]) -> None:
        """Serve the requests queued on the ROUTER now (a bounded batch), without blocking."""
        # NOTE: poll said readable, so the first receive cannot block; after that ask ZMQ_EVENTS instead of
        # letting a NOBLOCK receive raise zmq.Again (an exception costs several times more, cold after a transfer).
        for _ in range(_BATCH):
            # NOTE: requests are small, and copying them into bytes is cheaper than zmq.Frame objects.
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # not expected after a readable poll; kept as a guard
                return
            self._serve_one(router, frames)
            if not int(router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return

    def _settle(self, pub: zmq.Socket[Any]) -> None:
        """Publish new cache events and answer the parked gets they (or new failures) complete."""
        settled: list[str] = []
        while self._failed_inbox:
            mm_hash = self._failed_inbox.popleft()
            self._failed.add(mm_hash)
            settled.append(mm_hash)
        evicted: list[str] = []
        for seq, kind, mm_hash in self._cache.drain_events():
            self._publish(pub, self._event(seq, kind, [mm_hash]))
            self._published_seq = seq
            if kind == "stored":
                self._failed.discard(mm_hash)
                settled.append(mm_hash)
            else:
                evicted.append(mm_hash)
        if evicted and self._on_gathered is not None:  # gone: nobody can gather them any more (ungathered.py)
            self._on_gathered(evicted)
        for get in self._waits.resolve(settled, lambda h: self._cache.holds(h) or h in self._failed):
            self._answer(get)

    def _event(self, seq: int, kind: EventKind, hashes: list[str]) -> CacheEvent:
        assert self.address is not None
        return CacheEvent(producer=self.address, epoch=self.epoch, seq=seq, kind=kind, hashes=hashes)

    def _publish(self, pub: zmq.Socket[Any], header: CacheEvent) -> None:
        pub.send_multipart(encode_message(header), copy=False)
        self._num_events += 1

    def _serve_one(self, router: zmq.Socket[Any], frames: list[bytes]) -> None:
        identity, payload = frames[0], frames[1:]
        try:
            reply = self._handle(identity, payload)
        except WireError as e:
            reply = self._reject(payload, str(e))
        except Exception as e:  # noqa: BLE001 - no request may kill the serving thread
            logger.exception("producer failed to serve a request")
            reply = self._reject(payload, f"internal error: {type(e).__name__}")
        if reply is not None:
            router.send_multipart([identity, *encode_message(*reply)], copy=False)

    def _handle(self, identity: bytes, payload: list[bytes]) -> tuple[Message, list[memoryview]] | None:
        header, _ = decode_message(payload, self.max_message_bytes)
        req_id = header.req_id
        if isinstance(header, GetRequest):  # the hot op first
            if not header.traceparent:
                self._get(identity, header)
                return None
            with span("ec.get", {"epd.items": len(header.hashes), "epd.shm": header.shm, "epd.wait": len(header.wait)},
                      "server", header.traceparent):
                self._get(identity, header)
            return None
        if isinstance(header, PingRequest):
            return Pong(req_id=req_id), []
        if isinstance(header, HasRequest):
            hashes = self._check_count(header.hashes, "has")
            return HasReply(req_id=req_id, has=[self._cache.holds(h) for h in hashes]), []
        if isinstance(header, SnapshotRequest):
            seq, held = self._cache.snapshot()
            return SnapshotReply(req_id=req_id, epoch=self.epoch, seq=seq, hashes=held), []
        if isinstance(header, ShmProbe):
            self._num_shm_probes += 1
            probe = self._shm_probe
            return ShmProbeReply(req_id=req_id, epoch=self.epoch, handle=None if probe is None else probe.handle()), []
        raise WireError(f"{type(header).__name__} is not a request an EC producer serves")

    def _check_count(self, hashes: list[str], op: str) -> list[str]:
        if len(hashes) > self.max_items_per_get:
            raise WireError(f"{op} asks for {len(hashes)} hashes, over the {self.max_items_per_get}-item limit")
        return hashes

    def _get(self, identity: bytes, header: GetRequest) -> None:
        """Answer now, or park the get when it may wait for items still being encoded."""
        req_id, hashes = header.req_id, self._check_count(header.hashes, "get")
        if len(hashes) == 1 and not header.wait and 0 <= req_id < _MAX_REQ_ID:  # the common get: one item, no wait
            mm_hash = hashes[0]
            found = self._pin(hashes)
            try:
                held = found.get(mm_hash)
                parts = None if held is None else held.reply_parts(mm_hash, header.shm and self._shm_probe is not None)
                if held is not None and parts is not None:
                    if self._on_gathered is not None:  # before the send, as the counters: the consumer may look
                        self._on_gathered(hashes)
                    self._send_one(identity, req_id, held, parts)
                    return
            finally:
                self._cache.unpin(hashes)
        wait, wait_ms = set(header.wait), min(header.wait_ms, MAX_WAIT_MS)
        if not wait <= set(hashes):
            raise WireError("get `wait` must be a list of hashes the get asks for")
        keys = list(dict.fromkeys(hashes))
        found = self._pin(keys)
        try:
            missing = {h for h in keys if h not in found and h not in self._failed and not self._cache.holds(h)}
            if not (missing and missing <= wait and wait_ms > 0 and self._waits.can_park(len(hashes))):
                self._send_get_reply(identity, req_id, hashes, found, header.shm)
                return
        finally:
            self._cache.unpin(keys)
        self._waits.park(ParkedGet(identity, req_id, hashes, missing, time.monotonic() + wait_ms / 1000, header.shm))
        self._num_gets_waited += 1

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
        assert self._router is not None
        prefix, suffix, by_handle = parts
        self._num_gets_served += 1  # before the send: a consumer may read stats() the moment it has the reply
        router = self._router
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

    def _answer(self, get: ParkedGet) -> None:
        """Answer a parked get with whatever is there now."""
        keys = list(dict.fromkeys(get.hashes))
        found = self._pin(keys)
        try:
            self._send_get_reply(get.identity, get.req_id, get.hashes, found, get.shm)
        finally:
            self._cache.unpin(keys)

    def _send_get_reply(self, identity: bytes, req_id: int, hashes: list[str], found: dict[str, WireItem],
                        shm: bool = False) -> None:
        """Send a get's reply; the caller keeps the items pinned until ZeroMQ has taken the frames."""
        assert self._router is not None
        later = frozenset(h for h in hashes if h not in found and self._cache.holds(h)) if self._lower else frozenset()
        header, frames = get_reply(req_id, hashes, found, self._failed.frozen(hashes), self.max_reply_bytes,
                                   shm and self._shm_probe is not None, later)
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
        router, (head, *tensors) = self._router, encode_message(header, frames)
        # NOTE: send part by part: send_multipart adds flag arithmetic per part, costly on a cold cache
        router.send(identity, _MORE)
        router.send(head, _MORE if tensors else 0)
        for i, buf in enumerate(tensors, 1):
            router.send(buf, _MORE if i < len(tensors) else 0, copy=False)

    def _reject(self, payload: list[bytes], message: str) -> tuple[Message, list[memoryview]]:
        self._num_bad_messages += 1
        logger.warning("producer %s rejected a malformed message: %s", self.address, message)
        return ErrorReply(req_id=peek_req_id(payload), message=message), []
