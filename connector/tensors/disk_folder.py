"""The disk tier's folders: DIR (--ec-disk-dir) and DIR/<fingerprint>, each this process's user's alone.

Each is made 0700 if missing, opened with O_NOFOLLOW (a symlink is refused) and checked by fstat on the open fd
(epd_common/private_dir.py): one that another user owns, or that group or others can write, is refused with
DiskTierError naming the folder, its owner and its mode. DIR/.lock is held with flock for the process's life (one
encoder per folder). The tier then works only through the fds it opened.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from epd_common.private_dir import NotPrivateError, open_private_dir


class DiskTierError(RuntimeError):
    """The folder cannot be used (another encoder holds it, another user could change it, or it cannot be made)."""


def check_tier_folder(directory: str | Path) -> None:
    """Refuse (DiskTierError) a disk-tier folder another user could change, or one holding such a folder; made
    0700 if missing. An encoder runs this at start, before it loads its model, so a squatted folder stops it at
    once (every fingerprint folder is checked: which one is this model's is known only once it is loaded)."""
    top = open_top(Path(directory))
    try:
        with os.scandir(top) as entries:
            subfolders = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        for name in subfolders:
            os.close(open_private(name, top, Path(directory) / name, create=False))
    finally:
        os.close(top)


def open_top(directory: Path) -> int:
    """The fd of the tier's own folder (its missing parents made too), refused unless private."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DiskTierError(f"--ec-disk-dir {directory}: {e}") from None
    return open_private(directory, None, directory)


def open_private(name: str | Path, dir_fd: int | None, label: Path, create: bool = True) -> int:
    try:
        return open_private_dir(name, dir_fd, create, label=f"--ec-disk-dir folder {label}")
    except NotPrivateError as e:
        raise DiskTierError(str(e)) from None
    except OSError as e:
        raise DiskTierError(f"--ec-disk-dir {label}: {e}") from None


def open_tier_folder(directory: Path, fingerprint: str) -> tuple[int, int]:
    """(lock fd, fingerprint folder fd): DIR and DIR/<fingerprint> each made 0700 if missing, opened without
    following a symlink and refused unless private; DIR/.lock flocked for the process's life (one encoder per
    folder: a second gets DiskTierError)."""
    top = open_top(directory)
    try:
        lock_fd = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=top)
    except OSError as e:
        os.close(top)
        raise DiskTierError(f"--ec-disk-dir {directory}: {e}") from None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return lock_fd, open_private(fingerprint, top, directory / fingerprint)
    except BlockingIOError:
        os.close(lock_fd)
        raise DiskTierError(f"--ec-disk-dir {directory} is in use by another encoder (its .lock is held); "
                            "give each encoder a folder of its own") from None
    except BaseException:
        os.close(lock_fd)
        raise
    finally:
        os.close(top)
