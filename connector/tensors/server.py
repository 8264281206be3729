"""A producer's serving thread: ROUTER for `get`/`has`/`ping`/`snapshot`/`shm_probe`, PUB for cache events
(the gets themselves: connector/tensors/gets.py)."""

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
from connector.tensors.gets import GetAnswers, check_count
from connector.tensors.shm import Segment
from epd_common.tracing import span
from epd_contracts.ec import (
    HEARTBEAT_S,
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
_BATCH = 64  # requests served per wake-up before timers are checked again


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
        self._on_gathered = on_gathered
        self._gets = GetAnswers(cache, max_items_per_get=max_items_per_get, max_reply_bytes=max_reply_bytes,
                                max_parked_gets=max_parked_gets, max_parked_hashes=max_parked_hashes,
                                shm=shm_probe is not None, lower=lower, on_gathered=on_gathered)
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
        self._published_seq = 0
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
            **self._gets.stats(),
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
                self._gets.router = router
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
            waits = self._gets.waits
            if waits:  # nothing parked (the common case): no timers but the heartbeat
                for get in waits.expired(now):
                    self._gets.answer(get)
                deadline = min(next_beat, waits.next_deadline() or next_beat)
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
            self._gets.failed.add(mm_hash)
            settled.append(mm_hash)
        evicted: list[str] = []
        for seq, kind, mm_hash in self._cache.drain_events():
            self._publish(pub, self._event(seq, kind, [mm_hash]))
            self._published_seq = seq
            if kind == "stored":
                self._gets.failed.discard(mm_hash)
                settled.append(mm_hash)
            else:
                evicted.append(mm_hash)
        if evicted and self._on_gathered is not None:  # gone: nobody can gather them any more (ungathered.py)
            self._on_gathered(evicted)
        self._gets.settle(settled)

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
                self._gets.get(identity, header)
                return None
            with span("ec.get", {"epd.items": len(header.hashes), "epd.shm": header.shm, "epd.wait": len(header.wait)},
                      "server", header.traceparent):
                self._gets.get(identity, header)
            return None
        if isinstance(header, PingRequest):
            return Pong(req_id=req_id), []
        if isinstance(header, HasRequest):
            hashes = check_count(header.hashes, "has", self.max_items_per_get)
            return HasReply(req_id=req_id, has=[self._cache.holds(h) for h in hashes]), []
        if isinstance(header, SnapshotRequest):
            seq, held = self._cache.snapshot()
            return SnapshotReply(req_id=req_id, epoch=self.epoch, seq=seq, hashes=held), []
        if isinstance(header, ShmProbe):
            self._num_shm_probes += 1
            probe = self._shm_probe
            return ShmProbeReply(req_id=req_id, epoch=self.epoch, handle=None if probe is None else probe.handle()), []
        raise WireError(f"{type(header).__name__} is not a request an EC producer serves")

    def _reject(self, payload: list[bytes], message: str) -> tuple[Message, list[memoryview]]:
        self._num_bad_messages += 1
        logger.warning("producer %s rejected a malformed message: %s", self.address, message)
        return ErrorReply(req_id=peek_req_id(payload), message=message), []
