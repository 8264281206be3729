"""The disk tier's folders are this user's alone: one another user owns, or that group or others can write, is
refused naming the folder, its owner and its mode; so is a symlink; a file another user owns is skipped.

Making a folder another user's takes root (os.chown): those cases are skipped when the tests do not run as root.
The group- and other-writable cases work as any user."""
from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from connector.tensors.disk_format import encode_file, file_name
from connector.tensors.disk_tier import DiskTier, DiskTierError, check_tier_folder
from tests.connector.test_disk_tier import FP, KEY, features

OTHER_UID = 4242  # no one's: a user other than this process's
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user's (os.chown) needs root")


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "tier"
    for path in (tmp_path / "tier", tmp_path / "tier" / FP):  # let pytest remove what a test changed
        if path.is_dir() and not path.is_symlink():
            os.chmod(path, 0o700)


def refused(folder: Path, named: Path, owner: str, mode: str) -> None:
    """Both the tier and the start-up check refuse `folder`, naming `named`, its owner and its mode."""
    pattern = rf"{re.escape(str(named))} \(owner {owner}, mode {mode}\)"
    with pytest.raises(DiskTierError, match=pattern):
        check_tier_folder(folder)
    with pytest.raises(DiskTierError, match=pattern):
        DiskTier(folder, 1 << 20, FP, key=KEY)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o702])
def test_a_folder_group_or_others_can_write_is_refused(folder: Path, mode: int) -> None:
    folder.mkdir()
    os.chmod(folder, mode)
    refused(folder, folder, r".*\(uid \d+\)", f"{mode:04o}")


@pytest.mark.parametrize("mode", [0o777, 0o730])
def test_a_fingerprint_folder_group_or_others_can_write_is_refused(folder: Path, mode: int) -> None:
    (folder / FP).mkdir(parents=True, mode=0o700)
    os.chmod(folder / FP, mode)
    refused(folder, folder / FP, r".*\(uid \d+\)", f"{mode:04o}")


@as_root
def test_a_folder_another_user_owns_is_refused(folder: Path) -> None:
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, OTHER_UID)
    refused(folder, folder, f"uid {OTHER_UID}", "0700")


@as_root
def test_a_fingerprint_folder_another_user_owns_is_refused(folder: Path) -> None:
    (folder / FP).mkdir(parents=True, mode=0o700)
    os.chown(folder / FP, OTHER_UID, OTHER_UID)
    refused(folder, folder / FP, f"uid {OTHER_UID}", "0700")


def test_a_symlinked_tier_folder_is_refused(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DiskTierError, match="symlink"):
        check_tier_folder(folder)
    with pytest.raises(DiskTierError, match="symlink"):
        DiskTier(folder, 1 << 20, FP, key=KEY)


def test_new_folders_are_made_0700_and_a_0755_folder_of_ours_is_used(folder: Path, tmp_path: Path) -> None:
    DiskTier(folder, 1 << 20, FP, key=KEY).close()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 == stat.S_IMODE((folder / FP).stat().st_mode)
    (tmp_path / "readable").mkdir()
    os.chmod(tmp_path / "readable", 0o755)  # others may list it, not write it: the files in it are 0600
    DiskTier(tmp_path / "readable", 1 << 20, FP, key=KEY).close()


@as_root
def test_a_file_another_user_owns_is_skipped_and_removed(folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    (folder / FP).mkdir(parents=True, mode=0o700)
    path = folder / FP / file_name("planted")
    path.write_bytes(b"".join(bytes(memoryview(p).cast("B")) for p in encode_file(FP, "planted", features(1), KEY)))
    os.chown(path, OTHER_UID, OTHER_UID)  # even written under our key (root could): not ours, not used
    with caplog.at_level(logging.WARNING, logger="epd.connector"):
        tier = DiskTier(folder, 1 << 20, FP, key=KEY)
    try:
        assert tier.hashes() == [] and f"owned by uid {OTHER_UID}" in caplog.text and not path.exists()
    finally:
        tier.close()
