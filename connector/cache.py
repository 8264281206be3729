"""Byte-bounded LRU cache of encoder outputs, keyed by mm_hash."""

from __future__ import annotations

import threading
from collections import OrderedDict

from connector.types import EncoderOutput


class EmbeddingCache:
    """Thread-safe LRU that evicts least recently used items to stay under `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, EncoderOutput] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self._nbytes = 0
        self._num_hits = 0
        self._num_misses = 0
        self._num_evictions = 0

    def put(self, out: EncoderOutput) -> bool:
        """Store (or replace) an item; return False if it alone is over the byte bound."""
        if out.nbytes > self.max_bytes:
            return False
        with self._lock:
            self._discard(out.mm_hash)
            while self._nbytes + out.nbytes > self.max_bytes:
                _, oldest = self._items.popitem(last=False)
                self._nbytes -= oldest.nbytes
                self._num_evictions += 1
            self._items[out.mm_hash] = out
            self._nbytes += out.nbytes
        return True

    def get(self, mm_hash: str) -> EncoderOutput | None:
        """Return an item and mark it most recently used, counting the hit or miss."""
        with self._lock:
            out = self._items.get(mm_hash)
            if out is None:
                self._num_misses += 1
                return None
            self._items.move_to_end(mm_hash)
            self._num_hits += 1
            return out

    def __contains__(self, mm_hash: object) -> bool:
        with self._lock:
            return mm_hash in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def stats(self) -> dict[str, int]:
        """Counters for metrics and tests."""
        with self._lock:
            return {
                "num_items": len(self._items),
                "bytes": self._nbytes,
                "hits": self._num_hits,
                "misses": self._num_misses,
                "evictions": self._num_evictions,
            }

    def _discard(self, mm_hash: str) -> None:
        old = self._items.pop(mm_hash, None)
        if old is not None:
            self._nbytes -= old.nbytes
