"""Which images count as cached for usage's `cached_tokens`: only those the same `cache_salt` sent before.

An image's embeddings are shared by everyone (they are a function of its bytes, keyed by `mm_hash`), so a request
whose image someone else sent skips its vision work. Counting that as cached would tell the sender of an image
whether another tenant sent the same picture (a `cached_tokens` oracle across salts). So an image's tokens count as
cached only when this decoder has seen a request with the same salt carry the same `mm_hash` (the salt "" being
everyone's, as for the prefix cache). Per decoder and bounded: a repeat that lands on another decoder, or after
its pair was forgotten, reports fewer cached tokens than it saved, never more. Thread-safe (prepare runs on
worker threads).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

MAX_SALTED_ITEMS = 65_536  # (salt, mm_hash) pairs remembered, LRU: 16-byte digests, about 8 MiB at most
_TAG = b"epd-salted-hit-v1\0"

Held = tuple[tuple[int, int], ...]  # one item's [start, end) ranges of rows already held


class SaltedHits:
    def __init__(self, capacity: int = MAX_SALTED_ITEMS):
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def visible(self, salt: str, mm_hashes: Sequence[str], held: Sequence[Held]) -> list[Held]:
        """Each item's held ranges, kept only where `salt` sent that item before; then every item counts as sent by
        `salt` (for the next request)."""
        keys = [_pair(salt, h) for h in mm_hashes]
        with self._lock:
            out = [h if k in self._seen else () for k, h in zip(keys, held, strict=True)]
            for k in keys:
                self._seen[k] = None
                self._seen.move_to_end(k)
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._seen)


def _pair(salt: str, mm_hash: str) -> bytes:
    h = hashlib.blake2b(_TAG, digest_size=16)
    salted = salt.encode()
    h.update(len(salted).to_bytes(4, "big"))  # framed: no (salt, hash) pair reads as another
    h.update(salted)
    h.update(mm_hash.encode())
    return h.digest()
