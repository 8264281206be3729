"""The item files in a disk tier's fingerprint folder: indexed at start, read with their checks, written whole.

Every file operation is relative to the folder's fd and opened with O_NOFOLLOW, so a symlink in the folder (or a
file swapped for one) is never followed; a file not owned by this user is skipped. Every file is keyed
(disk_format.file_key of the internal key), so a file planted by anyone without the key fails its checks.

A write goes to a temporary file in the same folder, written whole, then renamed over its name, so a reader sees
an old file, a whole new one, or none. No fsync: a process crash (kill -9 included) keeps every renamed file (the
page cache is the kernel's); a power loss may leave a renamed file short or zeroed, which the start-up index
(length) or the first read (digest) finds and removes.

At start the folder is indexed: every file's header and length are checked, leftover temporary files are removed,
anything else (truncated, another format, model or key, a symlink, a folder, a name that is not its item's) is
skipped and logged, and removed unless it is a folder.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from connector.tensors.disk_format import SUFFIX, DiskFormatError, file_name, read_features, read_header
from connector.tensors.disk_space import NO_SPACE
from epd_contracts.embeddings import ImageFeatures

logger = logging.getLogger("epd.connector")

TMP_PREFIX = ".tmp-"
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class FileEntry:
    name: str
    size: int  # the file's bytes (header included): what the byte bound counts


class TierFiles:
    """The files of one fingerprint folder, opened as `dir_fd` (the tier owns the fd); `label` names it in logs."""

    def __init__(self, dir_fd: int, label: Path, fingerprint: str, max_item_bytes: int, key: bytes) -> None:
        self.dir_fd, self.label, self.fingerprint = dir_fd, label, fingerprint
        self.max_item_bytes, self._key = max_item_bytes, key

    def index(self) -> tuple[list[tuple[str, FileEntry]], int]:
        """(mm_hash, file) of every whole file of this fingerprint, oldest first, and how many entries were skipped
        (logged, and removed unless a folder: the folder is ours, and a file under another key would only take
        room). Leftover temporary files (a write cut short by kill -9) are removed."""
        found: list[tuple[int, str, FileEntry]] = []
        skipped = 0
        with os.scandir(self.dir_fd) as entries:
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX):  # never renamed, never used
                    self.remove(entry.name)
                    continue
                try:
                    mtime, mm_hash, size = self._check(entry)
                except (OSError, DiskFormatError) as e:
                    skipped += 1
                    logger.warning("disk tier: skipped %s/%s: %s", self.label, entry.name, e)
                    if not entry.is_dir(follow_symlinks=False):
                        self.remove(entry.name)
                    continue
                found.append((mtime, mm_hash, FileEntry(entry.name, size)))
        return [(mm_hash, held) for _, mm_hash, held in sorted(found, key=lambda f: f[0])], skipped

    def _check(self, entry: os.DirEntry[str]) -> tuple[int, str, int]:
        """(mtime, mm_hash, size) of a whole file of ours, else DiskFormatError (or OSError) saying why not."""
        if not entry.name.endswith(SUFFIX) or entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            raise DiskFormatError("not an embedding file (a symlink, a folder, or another name)")
        fd = os.open(entry.name, _OPEN_READ, dir_fd=self.dir_fd)
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

    def read(self, entry: FileEntry, mm_hash: str) -> ImageFeatures:
        """The item in `entry`'s file, its digest checked; DiskFormatError if the file changed since it was indexed."""
        fd = os.open(entry.name, _OPEN_READ, dir_fd=self.dir_fd)
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

    def write(self, name: str, parts: list[bytes | memoryview], size: int, make_room: Callable[[], bool]) -> bool:
        """Write `.tmp-<random>` whole and rename it to `name`; on a write that fails for space, `make_room()`
        (whether it freed anything) and one more try. False when the filesystem stays out of space."""
        for attempt in range(2):
            tmp = f"{TMP_PREFIX}{secrets.token_hex(8)}"
            try:
                fd = os.open(tmp, _OPEN_WRITE, 0o600, dir_fd=self.dir_fd)
                try:
                    write_all(fd, parts, size)
                finally:
                    os.close(fd)
                os.rename(tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                return True
            except OSError as e:
                self.remove(tmp)
                if e.errno not in NO_SPACE:
                    raise
            if attempt == 0 and not make_room():
                break
        return False

    def remove(self, name: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=self.dir_fd)

    def touch(self, name: str) -> None:
        """Mark a file as just used: modification times are the order of eviction across restarts."""
        with contextlib.suppress(OSError):
            os.utime(name, dir_fd=self.dir_fd, follow_symlinks=False)


def write_all(fd: int, parts: list[bytes | memoryview], size: int) -> None:
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
