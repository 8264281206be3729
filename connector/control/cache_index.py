"""Which embeddings the fleet holds: an index built from every producer's cache events.

Each producer publishes `stored`/`evicted` events with consecutive sequence numbers, plus heartbeats
that repeat its last seq. A subscriber that starts late, misses an event (a gap), or sees a new epoch
(the producer restarted with an empty cache) asks that producer for a snapshot and resyncs. Every proxy
keeps its own index, so several proxies share one view with no central store.

The index is a hint for recent items, bounded whatever the fleet holds (connector/control/hint_index.py): an item
it has forgotten is still found by placement: the scheduler sends it to its rendezvous home
(scheduler/rendezvous.py), the encoder that stored it, which answers it from its cache. So a proxy's memory is
O(encoders), not O(items).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from connector.control.client import ProducerClient
from connector.control.hint_index import INDEX_CAPACITY, HintIndex, ProducerView
from connector.control.security import CurveConfig, secure_client
from connector.control.waker import Waker
from connector.control.wire import WireError, apply_socket_limits, decode_message
from epd_contracts.ec import HEARTBEAT_S, CacheEvent

logger = logging.getLogger("epd.connector.index")

STALE_AFTER_S = 6 * HEARTBEAT_S  # a producer silent this long is presumed gone: forget what it held
_MAX_EVENT_BYTES = 1 << 20


class FleetCacheIndex:
    """has_cache_item for the whole fleet, answered locally from subscribed cache events."""

    def __init__(self, curve: CurveConfig | None = None, stale_after_s: float = STALE_AFTER_S,
                 snapshot_timeout: float = 2.0, capacity: int = INDEX_CAPACITY) -> None:
        self.curve = curve
        self._client = ProducerClient(curve)  # snapshots only: the index never fetches tensors
        self.stale_after_s, self.snapshot_timeout = stale_after_s, snapshot_timeout
        self._hint = HintIndex(capacity)
        self._changed = threading.Condition()  # guards _hint; notified on every change
        self._commands: list[tuple[str, ProducerView]] = []
        self._waker = Waker()
        self._stop = threading.Event()
        self.num_resyncs = 0
        self.num_events = 0
        self._thread = threading.Thread(target=self._run, name="epd-cache-index", daemon=True)
        self._thread.start()

    # any thread

    def add(self, address: str, events_address: str) -> None:
        """Follow one producer (idempotent); it is snapshotted right away."""
        self._command("add", ProducerView(address, events_address))

    def remove(self, address: str) -> None:
        self._command("remove", ProducerView(address, ""))

    def holders(self, mm_hash: str) -> list[str]:
        """Producer addresses that hold the item now."""
        with self._changed:
            return self._hint.holders(mm_hash)

    def has_cache_item(self, mm_hash: str) -> bool:
        return bool(self.holders(mm_hash))

    def view(self, address: str) -> ProducerCache:
        return ProducerCache(self, address)

    def is_synced(self, address: str) -> bool:
        with self._changed:
            v = self._hint.views.get(address)
            return v is not None and v.synced

    def held_by(self, address: str, mm_hashes: list[str]) -> list[bool]:
        with self._changed:
            return self._hint.held_by(address, mm_hashes)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until `predicate()` (checked after each index change) is true, or the timeout passes."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def has_seen(self, address: str, epoch: str, seq: int) -> bool:
        """Whether the index reflects producer `address` up to event `seq` of `epoch`."""
        with self._changed:
            v = self._hint.views.get(address)
            return v is not None and v.synced and v.epoch == epoch and v.seq >= seq

    def num_entries(self) -> int:
        """Hashes the index keeps now, over every producer: what its memory grows with (at most its capacity)."""
        with self._changed:
            return self._hint.num_entries()

    def close(self) -> None:
        self._stop.set()
        self._waker.wake()
        self._thread.join(timeout=5)
        self._waker.close()
        self._client.close()

    def _command(self, op: str, view: ProducerView) -> None:
        with self._changed:
            self._commands.append((op, view))
        self._waker.wake()

    # index thread: the only user of the SUB sockets

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._waker.fileno(), zmq.POLLIN)
        subs: dict[zmq.Socket[Any], ProducerView] = {}
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(int(HEARTBEAT_S * 1000)))
                if self._waker.fileno() in ready:
                    self._waker.drain()
                    self._run_commands(poller, subs)
                for sock in [s for s in subs if s in ready]:
                    self._drain(sock, subs[sock])
                self._expire(subs.values())
        finally:
            for sock in subs:
                sock.close(linger=0)

    def _run_commands(self, poller: zmq.Poller, subs: dict[zmq.Socket[Any], ProducerView]) -> None:
        with self._changed:
            commands, self._commands = self._commands, []
        for op, view in commands:
            for sock, old in list(subs.items()):
                if old.address == view.address:
                    poller.unregister(sock)
                    sock.close(linger=0)
                    del subs[sock]
            with self._changed:
                if op == "add":
                    self._hint.add(view)
                else:
                    self._hint.remove(view.address)
                self._changed.notify_all()
            if op == "add":
                sock = self._subscribe(view.events_address)
                poller.register(sock, zmq.POLLIN)
                subs[sock] = view
                self._resync(view)  # after subscribing, so no event falls between snapshot and stream

    def _subscribe(self, events_address: str) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        secure_client(sock, self.curve)
        apply_socket_limits(sock, _MAX_EVENT_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(events_address)
        return sock

    def _drain(self, sock: zmq.Socket[Any], view: ProducerView) -> None:
        """Apply every queued event of one producer; resync once if any is out of order."""
        needs_resync = False
        while sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart(copy=False)
            try:
                event, _ = decode_message(frames, _MAX_EVENT_BYTES)
                if not isinstance(event, CacheEvent):
                    raise WireError(f"not a cache event: {type(event).__name__}")
            except WireError as e:
                logger.warning("bad cache event from %s: %s", view.events_address, e)
                continue
            self.num_events += 1
            with self._changed:
                if needs_resync:
                    view.last_heard = time.monotonic()
                elif not view.apply_event(event):
                    needs_resync = True
                self._changed.notify_all()
        if needs_resync:
            self._resync(view)

    def _resync(self, view: ProducerView) -> None:
        snap = self._client.snapshot(view.address, self.snapshot_timeout)
        with self._changed:
            if snap is None:
                view.forget()
            else:
                view.apply_snapshot(snap)
                self.num_resyncs += 1
                logger.info("cache index synced with %s: epoch %s seq %d, %d item(s)",
                            view.address, snap.epoch, snap.seq, len(snap.hashes))
            self._changed.notify_all()

    def _expire(self, views: Any) -> None:
        now = time.monotonic()
        for view in views:
            if view.synced and now - view.last_heard > self.stale_after_s:
                logger.warning("no cache events from %s for %.1fs; forgetting its %d item(s)",
                               view.address, now - view.last_heard, len(view.held))
                with self._changed:
                    view.forget()
                    self._changed.notify_all()


class ProducerCache:
    """One producer's cache as the index sees it (what the scheduler asks per encoder)."""

    def __init__(self, index: FleetCacheIndex, address: str) -> None:
        self.index, self.address = index, address

    def has_cache_item(self, mm_hash: str) -> bool:
        return self.has_cache_items([mm_hash])[0]

    def has_cache_items(self, mm_hashes: list[str]) -> list[bool]:
        return self.index.held_by(self.address, mm_hashes)

