"""Byte-bounded LRU cache of image embeddings, keyed by mm_hash, with pins and an event journal."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, Literal, Protocol, TypeVar

Change = Literal["stored", "evicted"]
STORED: Change = "stored"
EVICTED: Change = "evicted"
JournalEntry = tuple[int, Change, str]  # (seq, STORED | EVICTED, mm_hash)


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


class Backing(Protocol):
    """A slower tier holding items past their eviction from memory (connector/tensors/disk_tier.py)."""

    def holds(self, mm_hash: str) -> bool: ...

    def hashes(self) -> list[str]: ...


T = TypeVar("T", bound=Sized)  # ImageFeatures (consumers), WireItem (producers)


class EmbeddingCache(Generic[T]):
    """Thread-safe LRU that evicts least recently used, unpinned items to stay under `max_bytes`.

    Every store and eviction gets the next sequence number; with `journal=True` the events are kept
    until `drain_events()` so a publisher can send them in order. `on_drop` is called (under the lock, so keep
    it short) with every item that leaves the cache, evicted or replaced: a producer closes its shared memory.
    A `put` may wait (up to its `wait_s`) for pins to be released when the pinned items leave it no room.

    With a `backing` tier, the items held are those in memory and those the backing holds: an item evicted from
    memory that the backing holds is not an "evicted" event, `snapshot()` lists both, and the backing reports
    what it stops holding with `forget()`.
    """

    def __init__(self, max_bytes: int, journal: bool = False, on_drop: Callable[[T], None] | None = None,
                 backing: Backing | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, T] = OrderedDict()  # oldest first
        self._pins: dict[str, int] = {}  # mm_hash -> users that must not lose it
        self._lock = threading.Lock()
        self._unpinned = threading.Condition(self._lock)  # notified when a pin goes while a put waits for room
        self._num_put_waiting = 0
        self._num_pin_waits = 0
        self._journal: list[JournalEntry] | None = [] if journal else None
        self._seq = 0
        self._nbytes = 0
        self._num_hits = 0
        self._num_misses = 0
        self._num_evictions = 0
        self._num_rejected = 0
        self._on_drop = on_drop
        self._backing = backing  # NOTE: its lock is taken under this one, never the other way round

    def put(self, mm_hash: str, item: T, wait_s: float = 0.0) -> bool:
        """Store (or replace) an item; False if it cannot fit beside the pinned items, waiting up to `wait_s` for
        pins to be released first (never for an item larger than the whole cache)."""
        with self._lock:
            if item.nbytes > self.max_bytes or not self._room_for(mm_hash, item.nbytes, wait_s):
                self._num_rejected += 1
                return False
            if mm_hash in self._items:
                self._drop(self._items.pop(mm_hash))
            self._evict_until(self.max_bytes - item.nbytes)
            self._items[mm_hash] = item
            self._nbytes += item.nbytes
            self._record(STORED, mm_hash)
        return True

    def get(self, mm_hash: str) -> T | None:
        """Return an item and mark it most recently used, counting the hit or miss."""
        with self._lock:
            out = self._items.get(mm_hash)
            if out is None:
                self._num_misses += 1
                return None
            self._items.move_to_end(mm_hash)
            self._num_hits += 1
            return out

    @contextlib.contextmanager
    def pinned(self, mm_hashes: Iterable[str]) -> Iterator[dict[str, T]]:
        """Hold the given items (those present) against eviction; yields them, refreshed as hits."""
        keys = list(dict.fromkeys(mm_hashes))
        try:
            yield self.pin(keys)
        finally:
            self.unpin(keys)

    def pin(self, keys: list[str]) -> dict[str, T]:
        """Pin `keys` (distinct) and return those present, refreshed as hits; pair with `unpin(keys)`."""
        found: dict[str, T] = {}
        with self._lock:
            for h in keys:
                self._pins[h] = self._pins.get(h, 0) + 1
                out = self._items.get(h)
                if out is None:
                    self._num_misses += 1
                else:
                    self._items.move_to_end(h)
                    self._num_hits += 1
                    found[h] = out
        return found

    def unpin(self, keys: list[str]) -> None:
        with self._lock:
            for h in keys:
                if self._pins[h] == 1:
                    del self._pins[h]
                else:
                    self._pins[h] -= 1
            if self._num_put_waiting:
                self._unpinned.notify_all()

    def clear(self) -> None:
        """Drop every item (pinned ones too), without events: the owner is shutting down."""
        with self._lock:
            items, self._items = list(self._items.values()), OrderedDict()
            for item in items:
                self._drop(item)

    def snapshot(self) -> tuple[int, list[str]]:
        """The sequence number of the last event and every held mm_hash (the backing's too), consistent."""
        with self._lock:
            if self._backing is None:
                return self._seq, list(self._items)
            return self._seq, list(dict.fromkeys([*self._items, *self._backing.hashes()]))

    def holds(self, mm_hash: str) -> bool:
        """In memory, or in the backing tier."""
        with self._lock:
            return mm_hash in self._items or (self._backing is not None and self._backing.holds(mm_hash))

    def forget(self, mm_hashes: list[str]) -> None:
        """The backing no longer holds these: an "evicted" event for each not in memory either."""
        with self._lock:
            for mm_hash in mm_hashes:
                if mm_hash not in self._items:
                    self._record(EVICTED, mm_hash)

    def drain_events(self) -> list[JournalEntry]:
        """Events recorded since the last drain, oldest first (empty without a journal)."""
        with self._lock:
            if not self._journal:
                return []
            events, self._journal = self._journal, []
            return events

    def __contains__(self, mm_hash: object) -> bool:
        with self._lock:
            return mm_hash in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def seq(self) -> int:
        return self._seq

    def stats(self) -> dict[str, int]:
        """Counters for metrics and tests."""
        with self._lock:
            return {
                "num_items": len(self._items),
                "bytes": self._nbytes,
                "max_bytes": self.max_bytes,
                "hits": self._num_hits,
                "misses": self._num_misses,
                "evictions": self._num_evictions,
                "rejected": self._num_rejected,
                "pinned": len(self._pins),
                "pin_waits": self._num_pin_waits,
            }

    # under self._lock

    def _room_for(self, mm_hash: str, nbytes: int, wait_s: float) -> bool:
        """Whether `nbytes` fit beside the pinned items (other than `mm_hash`), waiting up to `wait_s` for unpins."""
        if nbytes <= self.max_bytes - self._pinned_bytes(exclude=mm_hash):
            return True
        if wait_s <= 0:
            return False
        self._num_pin_waits += 1
        self._num_put_waiting += 1
        try:
            return self._unpinned.wait_for(
                lambda: nbytes <= self.max_bytes - self._pinned_bytes(exclude=mm_hash), timeout=wait_s)
        finally:
            self._num_put_waiting -= 1

    def _pinned_bytes(self, exclude: str) -> int:
        return sum(self._items[h].nbytes for h in self._pins if h in self._items and h != exclude)

    def _evict_until(self, limit: int) -> None:
        """Evict oldest unpinned items until at most `limit` bytes are held (the caller checked it can)."""
        victims, freed = [], 0
        for mm_hash, out in self._items.items():
            if self._nbytes - freed <= limit:
                break
            if mm_hash not in self._pins:
                victims.append(mm_hash)
                freed += out.nbytes
        for mm_hash in victims:
            self._drop(self._items.pop(mm_hash))
            self._num_evictions += 1
            if self._backing is None or not self._backing.holds(mm_hash):
                self._record(EVICTED, mm_hash)

    def _drop(self, item: T) -> None:
        self._nbytes -= item.nbytes
        if self._on_drop is not None:
            self._on_drop(item)

    def _record(self, kind: Change, mm_hash: str) -> None:
        self._seq += 1
        if self._journal is not None:
            self._journal.append((self._seq, kind, mm_hash))
