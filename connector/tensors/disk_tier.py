"""An encoder's disk tier: every stored embedding also written to a folder, kept through restarts, byte-bounded LRU.

Layout: DIR/.lock (held with flock for the process's life: one encoder per folder) and DIR/<fingerprint>/ with one
file per item (connector/tensors/disk_format.py). Only the fingerprint's own folder is ever read, written or
cleaned; the files of another model stay where they are, and a file found in ours that fails a check is removed.

The folders are this process's user's alone (epd_common/private_dir.py): DIR and DIR/<fingerprint> are opened
with O_NOFOLLOW, fstat-checked on the open fd and refused (DiskTierError, naming the folder, its owner and mode)
when another user owns them or group or others can write them; a file not owned by this user is skipped. Every
file is keyed (disk_format.file_key of the internal key), so a file planted by anyone without the key fails.

Writes happen on a thread of their own, behind the memory cache (write-through: a kill -9 loses only the items
still queued): a temporary file in the same folder, written whole, then renamed over its name, so a reader sees
an old file, a whole new one, or none. No fsync: a process crash (kill -9 included) keeps every renamed file (the
page cache is the kernel's); a power loss may leave a renamed file short or zeroed, which the start-up index
(length) or the first read (digest) finds and removes. Every file operation is relative to the folder's fd and
opened with O_NOFOLLOW, so a symlink in the folder (or a file swapped for one) is never followed.

At start the folder is indexed: every file's header and length are checked, leftover temporary files are removed,
anything else (truncated, another format, model or key, a symlink, a folder, a name that is not its item's) is
skipped and logged, and removed unless it is a folder. Order of eviction across restarts is the files'
modification times (touched on each read).

Bound: `max_bytes`, and the filesystem's free space (`cap_bytes`, connector/tensors/disk_space.py): before each
write the tier may hold at most what it holds plus what is free, less a reserve left to everyone else (5% of the
filesystem, at most 1 GiB); least recently used files are evicted to make room, and a write that fails for space
(ENOSPC, EDQUOT) evicts them and is tried once more. A full disk is logged once (until a write succeeds again) and
counted (`disk_no_space`), never per item.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from connector.control.wire import MAX_TENSOR_BYTES
from connector.tensors.disk_folder import DiskTierError, check_tier_folder, open_private, open_top
from connector.tensors.disk_format import SUFFIX, DiskFormatError, encode_file, file_name, read_features, read_header
from connector.tensors.disk_space import NO_SPACE, DiskSpace
from epd_contracts.embeddings import ImageFeatures

logger = logging.getLogger("epd.connector")

MAX_QUEUED_BYTES = 256 << 20  # embeddings waiting for the writer; past it a store is not written (counted)
_TMP_PREFIX = ".tmp-"
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
__all__ = ["DISK_KEYS", "DiskTier", "DiskTierError", "check_tier_folder"]
DISK_KEYS = ("disk_items", "disk_bytes", "disk_max_bytes", "disk_hits", "disk_misses", "disk_writes",
             "disk_write_bytes", "disk_write_seconds", "disk_read_bytes", "disk_read_seconds", "disk_evictions",
             "disk_skipped_files", "disk_failures", "disk_writes_dropped", "disk_queued_bytes", "disk_cap_bytes",
             "disk_no_space")


@dataclass
class _Entry:
    name: str
    size: int  # the file's bytes (header included): what the byte bound counts


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
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # mm_hash -> file, least recently used first
        self._pending: dict[str, ImageFeatures] = {}  # stored in memory, not written yet
        self._queue: deque[str] = deque()
        self._queued_bytes = self._nbytes = 0
        self._closed = False
        self._stats: dict[str, float] = dict.fromkeys(DISK_KEYS, 0)
        self._lock_fd, self._dir_fd = self._open_folder()
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
            features = self._read(entry, mm_hash)
        except (OSError, DiskFormatError) as e:  # evicted meanwhile, altered or forged: either way not held any more
            logger.warning("disk tier: %s (item %s) could not be read: %s", entry.name, mm_hash[:16], e)
            self._forget_entry(mm_hash, entry, failure=True)
            return None
        with self._lock:
            self._stats["disk_hits"] += 1
            self._stats["disk_read_bytes"] += entry.size
            self._stats["disk_read_seconds"] += time.perf_counter() - start
        with contextlib.suppress(OSError):  # the eviction order across restarts
            os.utime(entry.name, dir_fd=self._dir_fd, follow_symlinks=False)
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

    def _open_folder(self) -> tuple[int, int]:
        """(lock fd, fingerprint folder fd): DIR and DIR/<fingerprint> each made 0700 if missing, opened without
        following a symlink and refused unless private (epd_common.private_dir); DIR/.lock flocked."""
        top = open_top(self.directory)
        try:
            lock_fd = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=top)
        except OSError as e:
            os.close(top)
            raise DiskTierError(f"--ec-disk-dir {self.directory}: {e}") from None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock_fd, open_private(self.fingerprint, top, self.directory / self.fingerprint)
        except BlockingIOError:
            os.close(lock_fd)
            raise DiskTierError(f"--ec-disk-dir {self.directory} is in use by another encoder (its .lock is held); "
                                "give each encoder a folder of its own") from None
        except BaseException:
            os.close(lock_fd)
            raise
        finally:
            os.close(top)

    def _scan(self) -> None:
        """Index the folder: whole files of this fingerprint, oldest first; skip and log everything else."""
        found: list[tuple[int, str, _Entry]] = []
        with os.scandir(self._dir_fd) as entries:
            for entry in entries:
                if entry.name.startswith(_TMP_PREFIX):  # a write cut short (kill -9): never renamed, never used
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=self._dir_fd)
                    continue
                try:
                    mtime, mm_hash, size = self._check(entry)
                except (OSError, DiskFormatError) as e:
                    self._skip(entry, e)
                    continue
                found.append((mtime, mm_hash, _Entry(entry.name, size)))
        for _, mm_hash, held in sorted(found, key=lambda f: f[0]):
            self._index[mm_hash] = held
            self._nbytes += held.size
        self._evict_until(self.cap_bytes())  # the bound may have been lowered since, or the disk filled
        logger.info("disk tier %s: %d items, %d bytes (cap %d), %d files skipped",
                    self.directory / self.fingerprint, len(self._index), self._nbytes, self._space.cap,
                    self._stats["disk_skipped_files"])

    def _skip(self, entry: os.DirEntry[str], why: Exception) -> None:
        """Log and count an entry that is not a usable file of ours; remove it unless it is a folder (the folder
        is ours: nothing in it is another's to keep, and a file under another key would only take room)."""
        self._stats["disk_skipped_files"] += 1
        logger.warning("disk tier: skipped %s/%s: %s", self.directory / self.fingerprint, entry.name, why)
        if not entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(OSError):
                os.unlink(entry.name, dir_fd=self._dir_fd)

    def _check(self, entry: os.DirEntry[str]) -> tuple[int, str, int]:
        if not entry.name.endswith(SUFFIX) or entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            raise DiskFormatError("not an embedding file (a symlink, a folder, or another name)")
        fd = os.open(entry.name, _OPEN_READ, dir_fd=self._dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise DiskFormatError("not a regular file")
            if st.st_uid != os.geteuid():
                raise DiskFormatError(f"owned by uid {st.st_uid}, not by this process's user")
            header, _ = read_header(fd, st.st_size, self.fingerprint, self.max_item_bytes, self._key)
        finally:
            os.close(fd)
        if file_name(header.item.mm_hash) != entry.name:
            raise DiskFormatError("its name is not its item's")
        return st.st_mtime_ns, header.item.mm_hash, st.st_size

    # reads

    def _read(self, entry: _Entry, mm_hash: str) -> ImageFeatures:
        fd = os.open(entry.name, _OPEN_READ, dir_fd=self._dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                raise DiskFormatError(f"changed since it was indexed ({st.st_size} bytes, indexed {entry.size})")
            header, start = read_header(fd, st.st_size, self.fingerprint, self.max_item_bytes, self._key)
            if header.item.mm_hash != mm_hash:
                raise DiskFormatError("holds another item")
            return read_features(fd, header, start, self._key)
        finally:
            os.close(fd)

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
            if not self._make_room(size) or not self._write_file(name, parts, size):
                self._out_of_space(mm_hash)
                return False
        except Exception as e:  # noqa: BLE001 - a write that fails costs that item's file, never the writer
            with self._lock:
                self._stats["disk_failures"] += 1
            logger.error("disk tier: item %s not written: %s", mm_hash[:16], e)
            return False
        with self._lock:
            self._index[mm_hash] = _Entry(name, size)
            self._nbytes += size
            self._stats["disk_writes"] += 1
            self._stats["disk_write_bytes"] += size
            self._stats["disk_write_seconds"] += time.perf_counter() - start
            self._space.written()
        return True

    def _write_file(self, name: str, parts: list[bytes | memoryview], size: int) -> bool:
        """Write `.tmp-<random>` whole and rename it to `name`; False when the filesystem is out of space even
        after least recently used files of `size` bytes were removed to make room (a second try)."""
        for attempt in range(2):
            tmp = f"{_TMP_PREFIX}{secrets.token_hex(8)}"
            try:
                fd = os.open(tmp, _OPEN_WRITE, 0o600, dir_fd=self._dir_fd)
                try:
                    _write_all(fd, parts, size)
                finally:
                    os.close(fd)
                os.rename(tmp, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
                return True
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=self._dir_fd)
                if e.errno not in NO_SPACE:
                    raise
            if attempt == 0 and not self._evict(lambda: self._nbytes - size):
                break
        return False

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
            with contextlib.suppress(OSError):
                os.unlink(entry.name, dir_fd=self._dir_fd)
            if mm_hash not in self._pending:
                victims.append(mm_hash)
        return victims

    def _forget_entry(self, mm_hash: str, entry: _Entry, failure: bool) -> None:
        with self._lock:
            if self._index.get(mm_hash) is not entry:
                return
            del self._index[mm_hash]
            self._nbytes -= entry.size
            self._stats["disk_failures"] += failure
            with contextlib.suppress(OSError):
                os.unlink(entry.name, dir_fd=self._dir_fd)
        self.on_forget([mm_hash])


def _write_all(fd: int, parts: list[bytes | memoryview], size: int) -> None:
    """writev until every byte is down (a short write continues where it stopped)."""
    views = [memoryview(p).cast("B") for p in parts]
    written = 0
    while views:
        n = os.writev(fd, views)
        written += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    if written != size:
        raise OSError(errno.EIO, f"wrote {written} of {size} bytes")
