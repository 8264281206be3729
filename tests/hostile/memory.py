"""Memory of a process, read from /proc (Linux): what the hostile suite's bounds are checked with."""
from __future__ import annotations

import os


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory now."""
    return _status_kib(pid or os.getpid(), "VmRSS") * 1024


def peak_rss_bytes(pid: int | None = None) -> int:
    """Highest resident memory since the process started (VmHWM)."""
    return _status_kib(pid or os.getpid(), "VmHWM") * 1024
