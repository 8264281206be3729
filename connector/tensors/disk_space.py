"""The disk tier's room on its filesystem: what it may hold beside everyone else, and a full disk said once.

`DiskSpace.cap_bytes` bounds the tier by --ec-disk-bytes and by the filesystem (fstatvfs of the tier's folder):
what the tier holds plus what is free, less a reserve left to everyone else (5% of the filesystem, at most 1 GiB).
An item not written for want of space (the cap, or a write that failed with ENOSPC/EDQUOT twice) is counted
(`disk_no_space`) and logged once per episode: the warning comes with the first, and the episode ends, said at
info, when a write succeeds again. Eviction itself is the tier's (connector/tensors/disk_tier.py: its LRU index).

Not thread-safe on its own: the tier calls every method but `report_full` under its lock.
"""
from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

logger = logging.getLogger("epd.connector")

FREE_RESERVE_FRACTION, FREE_RESERVE_MAX = 0.05, 1 << 30  # of the filesystem, left free for everyone else
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a write's errno that means "no room" (evict and try once more)
_fstatvfs = os.fstatvfs  # tests give a full filesystem here


class DiskSpace:
    """The room of the tier whose folder is `dir_fd` (named `directory` in logs), at most `max_bytes`."""

    def __init__(self, dir_fd: int, max_bytes: int, directory: Path) -> None:
        self._dir_fd, self.max_bytes, self.directory = dir_fd, max_bytes, directory
        self.cap = max_bytes  # the last cap_bytes result (`disk_cap_bytes`)
        self.no_space = 0  # items not written for want of space (`disk_no_space`)
        self._full = False  # the filesystem was found full (logged once, until a write succeeds)

    def cap_bytes(self, held: int) -> int:
        """What the tier may hold now, holding `held` bytes: --ec-disk-bytes, or less when the filesystem has less
        room (its free space plus what the tier holds, less the reserve it leaves everyone else)."""
        try:
            fs = _fstatvfs(self._dir_fd)
        except OSError:
            return self.max_bytes
        reserve = min(FREE_RESERVE_MAX, int(fs.f_blocks * fs.f_frsize * FREE_RESERVE_FRACTION))
        self.cap = max(0, min(self.max_bytes, held + fs.f_bavail * fs.f_frsize - reserve))
        return self.cap

    def out_of_space(self) -> bool:
        """Count an item not written for want of space; True when it starts a full-disk episode (say it)."""
        self.no_space += 1
        first, self._full = not self._full, True
        return first

    def report_full(self, first: bool, mm_hash: str, held: int) -> None:
        """Log an item not written for want of space (outside the tier's lock): a warning once per episode."""
        if first:
            logger.warning("disk tier %s: the filesystem has no room (cap now %d bytes of --ec-disk-bytes %d, %d "
                           "held): items are not written until there is; this is logged once",
                           self.directory, self.cap, self.max_bytes, held)
        else:
            logger.debug("disk tier: item %s not written: no room", mm_hash[:16])

    def written(self) -> None:
        """A write succeeded: a full-disk episode, if one was on, is over (said once)."""
        if self._full:
            self._full = False
            logger.info("disk tier %s: files are written again", self.directory)
