"""Blocks of the K/V pool: who holds each one, and the prefix cache as references to full blocks.

Every block but the null block 0 is free, held (a reference count: the sequences whose block tables name it), or
cached and unreferenced. A full block of a prompt (or of tokens a sequence fed back) is named by its key in the
prefix hash chain (decoder_service/engine/prefix_hash.py: tokens, images by mm_hash, per salt); a later prompt
whose chain starts with the same keys takes references to those blocks instead of prefilling them again, so reuse
is zero-copy and lives in the one pool. Unreferenced cached blocks are an LRU that allocation evicts first-in
(a chain is released leaf first, so its root is the most recent and its ends are evicted before the prefix they
share); `cache_cap` bounds how many of them are kept (--prefix-cache-bytes).

Engine thread only, except `summary()` and `stats()` (under the lock, for /health and /metrics).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

MAX_ROUTE_KEYS = 4096  # the proxy's prefix keys reported in /health, most recent first


class NoFreeBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, block_bytes: int, caching: bool = True,
                 cache_cap: int | None = None):
        assert num_blocks >= 2, "the pool needs the null block and at least one more"
        self.num_blocks, self.block_size, self.block_bytes = num_blocks, block_size, block_bytes
        self.caching, self.cache_cap = caching, cache_cap
        self.refs = [0] * num_blocks
        # free blocks as a stack (last freed, first reused): a working set stays in the pages and caches it already
        # touched; a queue would walk the whole pool, faulting in (and on the CPU committing) every page of it
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.key_of: dict[int, bytes] = {}
        self.by_key: dict[bytes, int] = {}
        self.routes: OrderedDict[str, bytes] = OrderedDict()  # proxy prefix key -> the deepest block key it came with
        self.hits = self.misses = self.evicted = self.tokens_saved = 0
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free, or cached and unreferenced)."""
        return len(self.free) + len(self.evictable)

    @property
    def num_cached(self) -> int:
        return len(self.by_key)

    @property
    def nbytes(self) -> int:
        """K/V bytes of the blocks the prefix cache names (held by running rows or not)."""
        return self.num_cached * self.block_bytes

    @property
    def capacity(self) -> int:
        """Bytes of cached blocks kept once no row references them (--prefix-cache-bytes)."""
        return (self.cache_cap if self.cache_cap is not None else self.num_usable) * self.block_bytes

    @capacity.setter
    def capacity(self, nbytes: int) -> None:
        self.cache_cap = nbytes // self.block_bytes
        self._trim()

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of the chain's longest held prefix."""
        found: list[int] = []
        if self.caching:
            for key in keys:
                block = self.by_key.get(key)
                if block is None:
                    break
                found.append(block)
        return found

    def held_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of the chain's first blocks are held now (any thread: a hint, `match` again on the engine thread)."""
        if not self.caching:
            return 0
        with self._lock:
            n = 0
            for key in keys:
                if key not in self.by_key:
                    break
                n += 1
            return n

    def acquire(self, blocks: Sequence[int]) -> None:
        """References to held blocks (a prefix match, or an n > 1 fork's shared prompt blocks)."""
        for b in blocks:
            if self.refs[b] == 0:
                self.evictable.pop(b, None)
            self.refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for one holder (free ones first, then the least recently used cached ones); the caller zeroes
        them. NoFreeBlocks (nothing taken) if there are not enough."""
        if n > self.num_free:
            raise NoFreeBlocks(f"{n} blocks asked, {self.num_free} free")
        out: list[int] = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.evictable.popitem(last=False)
                self._forget(b)
                self.evicted += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """One holder's references go, leaf first: unreferenced cached blocks become evictable, others free."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            assert self.refs[b] >= 0, f"block {b} released more often than held"
            if self.refs[b] == 0:
                if b in self.key_of:
                    self.evictable[b] = None
                else:
                    self.free.append(b)
        self._trim()

    def register(self, blocks: Sequence[int], keys: Sequence[bytes]) -> int:
        """Name full blocks by their chain keys (from the chain's start); returns how many of the chain are held.
        A key already held by another block keeps that one (the duplicate stays unnamed)."""
        if not self.caching:
            return 0
        with self._lock:
            for b, key in zip(blocks, keys, strict=False):
                if key not in self.by_key and b not in self.key_of:
                    self.by_key[key], self.key_of[b] = b, key
        return len(self.match(keys))

    def note_routes(self, route_keys: Sequence[str], key: bytes) -> None:
        """The proxy's keys of a request whose K/V is held up to block `key`: reported while that block stays."""
        with self._lock:
            for rk in route_keys:
                self.routes[rk] = key
                self.routes.move_to_end(rk)
            while len(self.routes) > MAX_ROUTE_KEYS:
                self.routes.popitem(last=False)

    def record(self, reused_tokens: int) -> None:
        """One admitted prompt: a hit if it reused any tokens."""
        if reused_tokens:
            self.hits += 1
            self.tokens_saved += reused_tokens
        else:
            self.misses += 1

    def summary(self) -> dict[str, object]:
        """For /health: the pool, what the prefix cache holds, and the proxy's keys whose K/V is still here."""
        with self._lock:
            keys = [k for k, key in reversed(self.routes.items()) if key in self.by_key] if self.caching else []
            cap = self.cache_cap if self.cache_cap is not None else self.num_usable
            return {"enabled": self.caching, "block_size": self.block_size, "bytes": self.num_cached * self.block_bytes,
                    "capacity_bytes": cap * self.block_bytes if self.caching else 0, "blocks": self.num_cached,
                    "keys": keys}

    def pool_summary(self) -> dict[str, int]:
        return {"blocks_total": self.num_usable, "blocks_free": self.num_free, "blocks_cached": self.num_cached,
                "block_size": self.block_size}

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evicted_blocks": self.evicted,
                "tokens_saved": self.tokens_saved, "bytes": self.num_cached * self.block_bytes}

    def _trim(self) -> None:
        """Cached unreferenced blocks past the cap are freed, least recently used first."""
        if self.cache_cap is None:
            return
        while len(self.evictable) > self.cache_cap:
            b, _ = self.evictable.popitem(last=False)
            self._forget(b)
            self.free.append(b)
            self.evicted += 1

    def _forget(self, block: int) -> None:
        with self._lock:
            key = self.key_of.pop(block, None)
            if key is not None:
                del self.by_key[key]
