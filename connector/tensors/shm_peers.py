"""Which producers a consumer maps shared memory from: learnt per address by a probe, never assumed."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

logger = logging.getLogger("epd.connector")

RETRY_S = 30.0  # an address whose probe or handle failed is probed again after this long (socket meanwhile)


class ShmPeers:
    """Per producer address: the pid whose segments this consumer maps (a probe segment opened and its tag checked),
    or nothing (socket) until a retry is due. Thread-safe: concurrent gathers share it."""

    def __init__(self, enabled: bool, retry_s: float = RETRY_S) -> None:
        self.enabled, self.retry_s = enabled, retry_s
        self._pids: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}  # address -> when to probe it again
        self._lock = threading.Lock()

    def to_probe(self, addresses: Iterable[str]) -> list[str]:
        """The addresses to probe before asking them for handles: never probed, or a failure's retry is due."""
        if not self.enabled:
            return []
        now = time.monotonic()
        with self._lock:
            return [a for a in addresses if a not in self._pids and self._retry_at.get(a, 0.0) <= now]

    def pid(self, address: str) -> int | None:
        """The producer pid to ask handles of, or None: ask for frames."""
        with self._lock:
            return self._pids.get(address)

    def verified(self, address: str, pid: int) -> None:
        with self._lock:
            self._pids[address] = pid
            self._retry_at.pop(address, None)

    def failed(self, address: str, reason: str) -> None:
        """Use the socket with this producer until the retry is due (a restart, another host, shm off or full)."""
        with self._lock:
            had = self._pids.pop(address, None)
            self._retry_at[address] = time.monotonic() + self.retry_s
        if had is not None:
            logger.warning("shared memory with %s failed (%s); socket for %.0f s", address, reason, self.retry_s)
        else:
            logger.info("no shared memory with %s (%s); socket for %.0f s", address, reason, self.retry_s)

    def num_mapped(self) -> int:
        """Producers whose items this consumer currently maps."""
        with self._lock:
            return len(self._pids)
