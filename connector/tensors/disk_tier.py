"""An encoder's disk tier: every stored embedding also written to a folder, kept through restarts, byte-bounded LRU.

Layout: DIR/.lock (held with flock for the process's life: one encoder per folder) and DIR/<fingerprint>/ with one
file per item (connector/tensors/disk_format.py). Only the fingerprint's own folder is ever read, written or
cleaned; the files of another model stay where they are. The folders are this process's user's alone
(connector/tensors/disk_folder.py); how the files are checked, read and written is connector/tensors/disk_files.py.

Writes happen on a thread of their own, behind the memory cache (write-through: a kill -9 loses only the items
still queued). Order of eviction across restarts is the files' modification times (touched on each read).

Bound: `max_bytes`, and the filesystem's free space (`cap_bytes`, connector/tensors/disk_space.py): before each
write the tier may hold at most what it holds plus what is free, less a reserve left to everyone else (5% of the
filesystem, at most 1 GiB); least recently used files are evicted to make room, and a write that fails for space
(ENOSPC, EDQUOT) evicts them and is tried once more. A full disk is logged once (until a write succeeds again) and
counted (`disk_no_space`), never per item.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path

from connector.control.wire import MAX_TENSOR_BYTES
from connector.tensors.disk_files import FileEntry, TierFiles
from connector.tensors.disk_folder import DiskTierError, check_tier_folder, open_tier_folder
from connector.tensors.disk_format import DiskFormatError, encode_file, file_name
from connector.tensors.disk_space import DiskSpace
from epd_contracts.embeddings import ImageFeatures

logger = logging.getLogger("epd.connector")

MAX_QUEUED_BYTES = 256 << 20  # embeddings waiting for the writer; past it a store is not written (counted)
__all__ = ["DISK_KEYS", "DiskTier", "DiskTierError", "check_tier_folder"]
DISK_KEYS = ("disk_items", "disk_bytes", "disk_max_bytes", "disk_hits", "disk_misses", "disk_writes",
             "disk_write_bytes", "disk_write_seconds", "disk_read_bytes", "disk_read_seconds", "disk_evictions",
             "disk_skipped_files", "disk_failures", "disk_writes_dropped", "disk_queued_bytes", "disk_cap_bytes",
             "disk_no_space")


class DiskTier:
    """Embeddings on disk under one model fingerprint. Thread-safe; `on_forget` is called (outside the tier's lock)
    with hashes the tier stopped holding (evicted, unreadable, or a write that failed)."""

    def __init__(self, directory: str | Path, max_bytes: int, fingerprint: str, *, key: bytes,
                 max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.directory, self.max_bytes, self.fingerprint = Path(directory), max_bytes, fingerprint
        self._key = key  # disk_format.file_key(internal key): files written without it fail their checks
        self.max_item_bytes = min(max_bytes, MAX_TENSOR_BYTES)
        self.max_queued_bytes = max_queued_bytes
        self.on_forget: Callable[[list[str]], None] = lambda hashes: None
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)
        self._index: OrderedDict[str, FileEntry] = OrderedDict()  # mm_hash -> file, least recently used first
        self._pending: dict[str, ImageFeatures] = {}  # stored in memory, not written yet
        self._queue: deque[str] = deque()
        self._queued_bytes = self._nbytes = 0
        self._closed = False
        self._stats: dict[str, float] = dict.fromkeys(DISK_KEYS, 0)
        self._lock_fd, self._dir_fd = open_tier_folder(self.directory, fingerprint)
        self._files = TierFiles(self._dir_fd, self.directory / fingerprint, fingerprint, self.max_item_bytes, key)
        self._space = DiskSpace(self._dir_fd, max_bytes, self.directory)  # the filesystem's room (under the lock)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="epd-ec-disk", daemon=True)
        self._writer.start()

    # any thread

    def holds(self, mm_hash: str) -> bool:
        with self._lock:
            return mm_hash in self._index or mm_hash in self._pending

    def hashes(self) -> list[str]:
        with self._lock:
            return [*self._index, *(h for h in self._pending if h not in self._index)]

    def put(self, mm_hash: str, features: ImageFeatures) -> bool:
        """Queue an item for writing (False: larger than the tier, already held, or the queue is full)."""
        nbytes = features.nbytes
        with self._lock:
            if self._closed or mm_hash in self._pending or mm_hash in self._index:
                return False
            if nbytes > self.max_item_bytes or self._queued_bytes + nbytes > self.max_queued_bytes:
                self._stats["disk_writes_dropped"] += 1
                return False
            self._pending[mm_hash] = features
            self._queue.append(mm_hash)
            self._queued_bytes += nbytes
            self._queued.notify()
        return True

    def load(self, mm_hash: str) -> ImageFeatures | None:
        """The item, read from its file (its digest checked) or still queued; None if not held or unreadable."""
        with self._lock:
            queued = self._pending.get(mm_hash)
            entry = self._index.get(mm_hash)
            if queued is not None:
                self._stats["disk_hits"] += 1
                return queued
            if entry is None:
                self._stats["disk_misses"] += 1
                return None
            self._index.move_to_end(mm_hash)
        start = time.perf_counter()
        try:
            features = self._files.read(entry, mm_hash)
        except (OSError, DiskFormatError) as e:  # evicted meanwhile, altered or forged: either way not held any more
            logger.warning("disk tier: %s (item %s) could not be read: %s", entry.name, mm_hash[:16], e)
            self._forget_entry(mm_hash, entry, failure=True)
            return None
        with self._lock:
            self._stats["disk_hits"] += 1
            self._stats["disk_read_bytes"] += entry.size
            self._stats["disk_read_seconds"] += time.perf_counter() - start
        self._files.touch(entry.name)
        return features

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self._stats, "disk_items": len(self._index), "disk_bytes": self._nbytes,
                    "disk_max_bytes": self.max_bytes, "disk_queued_bytes": self._queued_bytes,
                    "disk_cap_bytes": self._space.cap, "disk_no_space": self._space.no_space}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued item is written (or dropped); False on timeout."""
        with self._queued:
            return self._queued.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to `timeout`), stop the writer, release the folder."""
        self.flush(timeout)
        with self._queued:
            self._closed = True
            self._queued.notify_all()
        self._writer.join(timeout=timeout)
        os.close(self._dir_fd)
        os.close(self._lock_fd)  # releases the flock

    # start-up

    def _scan(self) -> None:
        """Index the folder's whole files of this fingerprint, oldest first (disk_files: the rest is skipped)."""
        found, skipped = self._files.index()
        for mm_hash, held in found:
            self._index[mm_hash] = held
            self._nbytes += held.size
        self._stats["disk_skipped_files"] += skipped
        self._evict_until(self.cap_bytes())  # the bound may have been lowered since, or the disk filled
        logger.info("disk tier %s: %d items, %d bytes (cap %d), %d files skipped",
                    self.directory / self.fingerprint, len(self._index), self._nbytes, self._space.cap, skipped)

    # the writer thread

    def _write_loop(self) -> None:
        while True:
            with self._queued:
                self._queued.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                mm_hash = self._queue.popleft()
                features = self._pending[mm_hash]
            written = self._write(mm_hash, features)
            with self._queued:
                del self._pending[mm_hash]
                self._queued_bytes -= features.nbytes
                self._queued.notify_all()
            if not written:
                self.on_forget([mm_hash])

    def _write(self, mm_hash: str, features: ImageFeatures) -> bool:
        start = time.perf_counter()
        name = file_name(mm_hash)
        try:
            parts = encode_file(self.fingerprint, mm_hash, features, self._key)
            size = sum(memoryview(p).nbytes for p in parts)
            if size > self.max_bytes:
                raise DiskFormatError(f"{size} bytes is more than the tier's {self.max_bytes}")
            if not self._make_room(size) or not self._files.write(name, parts, size, self._room_for(size)):
                self._out_of_space(mm_hash)
                return False
        except Exception as e:  # noqa: BLE001 - a write that fails costs that item's file, never the writer
            with self._lock:
                self._stats["disk_failures"] += 1
            logger.error("disk tier: item %s not written: %s", mm_hash[:16], e)
            return False
        with self._lock:
            self._index[mm_hash] = FileEntry(name, size)
            self._nbytes += size
            self._stats["disk_writes"] += 1
            self._stats["disk_write_bytes"] += size
            self._stats["disk_write_seconds"] += time.perf_counter() - start
            self._space.written()
        return True

    def _out_of_space(self, mm_hash: str) -> None:
        """An item not written for want of space: counted; logged once until a write succeeds again."""
        with self._lock:
            first = self._space.out_of_space()
        self._space.report_full(first, mm_hash, self._nbytes)

    def cap_bytes(self) -> int:
        """What the tier may hold now: --ec-disk-bytes, or less when the filesystem has less room (its free space
        plus what the tier holds, less the reserve it leaves everyone else). Call under the lock."""
        return self._space.cap_bytes(self._nbytes)

    def _make_room(self, size: int) -> bool:
        """Evict until a file of `size` fits the cap; False (nothing evicted) when it cannot fit at all."""
        with self._lock:
            if size > self.cap_bytes():
                return False
        self._evict(lambda: self.cap_bytes() - size)
        return True

    def _room_for(self, size: int) -> Callable[[], bool]:
        """What a write that failed for space calls before its second try: evict files of `size` bytes."""
        return lambda: self._evict(lambda: self._nbytes - size)

    def _evict(self, limit: Callable[[], int]) -> bool:
        """Evict down to `limit()` bytes (evaluated under the lock); whether anything was evicted."""
        with self._lock:
            victims = self._evict_until(limit())
        if victims:
            self.on_forget(victims)
        return bool(victims)

    def _evict_until(self, limit: int) -> list[str]:
        """Remove least recently used files until at most `limit` bytes are held (under the lock)."""
        victims = []
        while self._index and self._nbytes > limit:
            mm_hash, entry = self._index.popitem(last=False)
            self._nbytes -= entry.size
            self._stats["disk_evictions"] += 1
            self._files.remove(entry.name)
            if mm_hash not in self._pending:
                victims.append(mm_hash)
        return victims

    def _forget_entry(self, mm_hash: str, entry: FileEntry, failure: bool) -> None:
        with self._lock:
            if self._index.get(mm_hash) is not entry:
                return
            del self._index[mm_hash]
            self._nbytes -= entry.size
            self._stats["disk_failures"] += failure
            self._files.remove(entry.name)
        self.on_forget([mm_hash])

