"""Bytes of embeddings an encoder stored that no decoder has gathered yet: what admission bounds.

An encoder that runs ahead of its decoders fills its cache with items nobody has fetched, and the LRU then evicts
items before they are gathered (a wasted encode, and a slower request). The encoder refuses new work past a bound
on these bytes (encoder_service/server.py). An item counts from its store until the first get that finds it, its
eviction, or `max_age_s`: a client that left never has its items gathered, and they must not hold admission shut.

A request's own items never count against it (`nbytes(exclude=request_id)`): a request whose first items wait for
its last ones (a decoder gathers them together) must not be refused for them, or it would wait for itself. Two
requests that each wait for the other's refusal are freed by the age limit, which is below the proxy's
--encoder-busy-timeout (30 s) so that its retries outlast it.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

UNGATHERED_MAX_AGE_S = 10.0


class Ungathered:
    def __init__(self, max_age_s: float = UNGATHERED_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        # mm_hash -> (stored at, bytes, the request ids it was encoded for), oldest first
        self._items: OrderedDict[str, tuple[float, int, frozenset[str]]] = OrderedDict()
        self._nbytes = 0
        self.num_aged_out = 0

    def stored(self, mm_hash: str, nbytes: int, owners: frozenset[str] = frozenset()) -> None:
        with self._lock:
            self._pop(mm_hash)
            self._items[mm_hash] = (time.monotonic(), nbytes, owners)
            self._nbytes += nbytes

    def gathered(self, mm_hashes: list[str]) -> None:
        """Found by a get, or gone from the cache: no longer waiting."""
        with self._lock:
            for mm_hash in mm_hashes:
                self._pop(mm_hash)

    def nbytes(self, exclude: str | None = None) -> int:
        """The bytes waiting, those of request `exclude` left out."""
        with self._lock:
            oldest = time.monotonic() - self.max_age_s
            while self._items:
                mm_hash, (at, _, _) = next(iter(self._items.items()))
                if at > oldest:
                    break
                self._pop(mm_hash)
                self.num_aged_out += 1
            if exclude is None:
                return self._nbytes
            return self._nbytes - sum(n for _, n, owners in self._items.values() if exclude in owners)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _pop(self, mm_hash: str) -> None:
        held = self._items.pop(mm_hash, None)
        if held is not None:
            self._nbytes -= held[1]
