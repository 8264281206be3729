"""Folders only this process's user can change: opened without following a symlink and checked by `fstat` on the
open fd (what was checked is what is used; a path swapped afterwards changes nothing), so another local user can
neither plant files in them nor redirect them.

A folder is refused when this process's effective user does not own it or when its group or others can write it
(`NotPrivateError`, naming the folder, its owner and its mode). One this module makes is made 0700.
"""
from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from pathlib import Path

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotPrivateError(PermissionError):
    """A folder that another user could change (or that is not a folder): refused, never repaired."""


def user_name(uid: int) -> str:
    """`name (uid N)`, or `uid N` when the user database does not know it."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_private(fd: int, label: str) -> None:
    """Refuse the open folder `fd` (`label` names it in the message) unless it is ours and no one else can write it."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    problems = []
    if not stat.S_ISDIR(st.st_mode):
        problems.append("it is not a folder")
    if st.st_uid != os.geteuid():
        problems.append(f"it is not owned by this process's user, {user_name(os.geteuid())}")
    if mode & 0o022:
        problems.append("its group or others can write it")
    if problems:
        raise NotPrivateError(f"{label} (owner {user_name(st.st_uid)}, mode {mode:04o}): {' and '.join(problems)}, "
                              "so another user could plant or replace files in it; use a folder of your own that "
                              "only you can write (e.g. `chmod 700`), or a new one")


def open_private_dir(name: str | Path, dir_fd: int | None = None, create: bool = True, label: str | None = None) -> int:
    """The fd of folder `name` (relative to `dir_fd` when given), made 0700 if missing and `create`; a symlink is
    refused (O_NOFOLLOW), and so is a folder `check_private` refuses. The caller closes the fd."""
    label = label or str(name)
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
    try:
        fd = os.open(name, _OPEN_DIR, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotPrivateError(f"{label}: a symlink or not a folder ({e.strerror})") from None
        raise
    try:
        check_private(fd, label)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_private_dir(path: str | Path) -> None:
    """Make `path` (and its missing parents) and refuse it unless private (`open_private_dir`); nothing kept open."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(open_private_dir(path))
