"""The disk tier under a filesystem with less room than --ec-disk-bytes: it stays within the free space (less the
reserve it leaves everyone else), evicts when a write fails for space, and says so once, not per item."""
from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from connector.tensors import disk_files, disk_space
from connector.tensors.disk_format import encode_file
from connector.tensors.disk_space import FREE_RESERVE_FRACTION
from connector.tensors.disk_tier import DiskTier
from tests.connector.test_disk_tier import FP, KEY, WAIT_S, features

FILE = sum(memoryview(p).nbytes for p in encode_file(FP, "h0", features(0), KEY))  # each file of h<i>
BIG_FLAG = 1 << 30  # --ec-disk-bytes far above the filesystem's size, as the 16 GiB default on a small disk


def used(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.emb"))


@pytest.fixture
def tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], DiskTier]]:
    """A tier on a fake filesystem of `size` bytes that only the tier's files take room on."""
    opened: list[DiskTier] = []

    def make(size: int) -> DiskTier:
        monkeypatch.setattr(disk_space, "_fstatvfs", lambda fd: SimpleNamespace(
            f_frsize=1, f_blocks=size, f_bavail=max(0, size - used(tmp_path))))
        opened.append(DiskTier(tmp_path, BIG_FLAG, FP, key=KEY))
        return opened[-1]
    yield make
    for t in opened:
        t.close()


def write(t: DiskTier, names: list[str]) -> None:
    for i, h in enumerate(names):
        assert t.put(h, features(i))
    assert t.flush(WAIT_S)


def test_the_tier_stays_within_the_filesystems_free_space(tier: Callable[[int], DiskTier], tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    size = int((4 * FILE + FILE // 2) / (1 - FREE_RESERVE_FRACTION))  # room for four files beside the reserve
    t = tier(size)
    forgotten: list[str] = []
    t.on_forget = forgotten.extend
    with caplog.at_level(logging.WARNING, logger="epd.connector"):
        write(t, [f"h{i}" for i in range(8)])
    s = t.stats()
    assert s["disk_writes"] == 8 and s["disk_no_space"] == 0 and not caplog.records  # room was made for each
    assert used(tmp_path) == s["disk_bytes"] == 4 * FILE <= size * (1 - FREE_RESERVE_FRACTION)
    assert s["disk_cap_bytes"] < s["disk_max_bytes"] == BIG_FLAG
    assert forgotten == ["h0", "h1", "h2", "h3"] and t.hashes() == ["h4", "h5", "h6", "h7"]


def test_no_room_at_all_is_logged_once_not_per_item(tier: Callable[[int], DiskTier], tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    t = tier(FILE)  # less than one file beside the reserve
    with caplog.at_level(logging.WARNING, logger="epd.connector"):
        write(t, [f"h{i}" for i in range(5)])
    assert t.stats()["disk_no_space"] == 5 and t.stats()["disk_writes"] == 0 and used(tmp_path) == 0
    assert len([r for r in caplog.records if "no room" in r.getMessage()]) == 1, caplog.text


@pytest.fixture
def enospc(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Writes fail with ENOSPC while the list holds a count above 0 (each failure takes one off; -1: always)."""
    left = [0]
    real = disk_files.write_all

    def write_all(fd: int, parts: list[bytes | memoryview], size: int) -> None:
        if left[0]:
            left[0] -= left[0] > 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, parts, size)
    monkeypatch.setattr(disk_files, "write_all", write_all)
    return left


def test_a_write_that_fails_for_space_evicts_and_is_tried_again(tmp_path: Path, enospc: list[int]) -> None:
    t = DiskTier(tmp_path, BIG_FLAG, FP, key=KEY)
    try:
        forgotten: list[str] = []
        t.on_forget = forgotten.extend
        write(t, ["a", "b", "c"])
        enospc[0] = 1
        write(t, ["d"])
        assert t.hashes() == ["b", "c", "d"] and forgotten == ["a"]  # the least recently used made room
        assert t.stats()["disk_evictions"] == 1 and t.stats()["disk_no_space"] == 0
        assert not [n for n in os.listdir(tmp_path / FP) if n.startswith(".tmp-")]
    finally:
        t.close()


def test_a_full_disk_is_logged_once_until_a_write_succeeds(tmp_path: Path, enospc: list[int],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    t = DiskTier(tmp_path, BIG_FLAG, FP, key=KEY)
    try:
        write(t, ["a", "b"])
        enospc[0] = -1
        with caplog.at_level(logging.INFO, logger="epd.connector"):
            write(t, [f"full{i}" for i in range(6)])
            assert len([r for r in caplog.records if "no room" in r.getMessage()]) == 1, caplog.text
            assert t.stats()["disk_no_space"] == 6 and t.hashes() == []  # it gave up its own files first
            enospc[0] = 0
            write(t, ["ok"])
            assert t.hashes() == ["ok"] and "written again" in caplog.text
            enospc[0] = -1
            write(t, ["full-again"])
        assert len([r for r in caplog.records if "no room" in r.getMessage()]) == 2  # a new episode, said again
    finally:
        t.close()
