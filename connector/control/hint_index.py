"""What each producer holds as its events say, bounded: the socket-free half of the fleet cache index.

`ProducerView` applies one producer's snapshot and events in order; `HintIndex` keeps a view per producer plus, for
each hash, which producers hold it (so "who holds this item" costs one lookup, not one per producer), and shares a
fixed `capacity` among the producers: each keeps its most recently stored hashes. It is a hint for recent items; an
item it has forgotten is found by placement (scheduler/rendezvous.py). connector/control/cache_index.py feeds it from
the producers' sockets; the fleet simulator (epd_bench/fleet_sim.py) feeds it directly.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from epd_contracts.ec import CacheEvent, SnapshotReply

INDEX_CAPACITY = 65_536  # hashes the whole index keeps (a few MB at most), shared evenly by its producers
MIN_PER_PRODUCER = 64  # ... but at least this many per producer, however many producers there are


@dataclass
class ProducerView:
    """What one producer holds, as far as its events say; `synced` once a snapshot was applied."""

    address: str
    events_address: str
    epoch: str | None = None
    seq: int = 0
    held: OrderedDict[str, None] = field(default_factory=OrderedDict)  # the most recently stored hashes, oldest first
    synced: bool = False
    last_heard: float = field(default_factory=time.monotonic)
    cap: int = INDEX_CAPACITY  # the most hashes `held` keeps
    # hash -> holders, shared by an index; a tuple (one holder, mostly): a third of a set's bytes
    where: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)

    def apply_snapshot(self, snap: SnapshotReply) -> None:
        """Take a snapshot (oldest first, as the producer's cache lists them): its newest `cap` hashes."""
        self._drop_all()
        self.epoch, self.seq, self.synced = snap.epoch, snap.seq, True
        self.stored(snap.hashes[-self.cap:] if self.cap else [])

    def apply_event(self, event: CacheEvent) -> bool:
        """Apply one event in order; False when a snapshot is needed (new epoch, gap, or not synced)."""
        self.last_heard = time.monotonic()
        if not self.synced or event.epoch != self.epoch:
            return False
        if event.kind == "heartbeat":
            return event.seq <= self.seq  # a higher seq means events were missed
        if event.seq <= self.seq:
            return True  # already part of the snapshot
        if event.seq != self.seq + 1:
            return False
        self.seq = event.seq
        if event.kind == "stored":
            self.stored(event.hashes)
        else:
            self.evicted(event.hashes)
        return True

    def stored(self, hashes: Iterable[str]) -> None:
        """The producer stored these (newest last); the oldest past `cap` are forgotten."""
        for h in hashes:
            if h in self.held:
                self.held.move_to_end(h)
            else:
                self.held[h] = None
                self.where[h] = (*self.where.get(h, ()), self.address)
        self.trim()

    def evicted(self, hashes: Iterable[str]) -> None:
        for h in hashes:
            if h in self.held:
                del self.held[h]
                self._unwhere(h)

    def trim(self) -> None:
        """Forget the oldest hashes past `cap` (they stay where they are: placement still finds them)."""
        while len(self.held) > self.cap:
            self._unwhere(self.held.popitem(last=False)[0])

    def forget(self) -> None:
        self._drop_all()
        self.synced = False

    def _drop_all(self) -> None:
        for h in self.held:
            self._unwhere(h)
        self.held = OrderedDict()

    def _unwhere(self, h: str) -> None:
        left = tuple(a for a in self.where.get(h, ()) if a != self.address)
        if left:
            self.where[h] = left
        else:
            self.where.pop(h, None)


class HintIndex:
    """A view per producer, the holders of each hash, and the capacity they share. Not thread-safe: the caller
    locks (FleetCacheIndex does)."""

    def __init__(self, capacity: int = INDEX_CAPACITY):
        self.capacity = capacity
        self.views: dict[str, ProducerView] = {}  # producer address -> view
        self.where: dict[str, tuple[str, ...]] = {}  # hash -> addresses of the synced producers holding it

    def add(self, view: ProducerView) -> None:
        """Follow a producer (replacing any view of that address); every view's share of the capacity is redone."""
        self.remove(view.address)
        view.where = self.where
        self.views[view.address] = view
        self._share()

    def remove(self, address: str) -> None:
        old = self.views.pop(address, None)
        if old is not None:
            old.forget()
            self._share()

    def holders(self, mm_hash: str) -> list[str]:
        """Addresses of the producers known to hold the item now."""
        return sorted(self.where.get(mm_hash, ()))

    def held_by(self, address: str, mm_hashes: list[str]) -> list[bool]:
        v = self.views.get(address)
        return [v is not None and v.synced and h in v.held for h in mm_hashes]

    def num_entries(self) -> int:
        """Hashes kept now, over every producer: what the index's memory grows with (at most about its capacity)."""
        return sum(len(v.held) for v in self.views.values())

    def _share(self) -> None:
        """Give each producer its even share of the capacity (at least MIN_PER_PRODUCER), trimming each."""
        cap = max(MIN_PER_PRODUCER, self.capacity // max(1, len(self.views)))
        for view in self.views.values():
            view.cap = cap
            view.trim()
