"""Every check of the disk tier's file format, each on its own: a file with exactly one defect, named for its own
item (so the tier's name check passes it on), is refused for that defect's reason, by `read_header` /
`read_features` and by the tier's start-up index."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from connector.tensors.disk_format import (
    MAGIC,
    DiskFormatError,
    DiskHeader,
    encode_file,
    encode_head,
    file_key,
    file_name,
    read_features,
    read_header,
)
from connector.tensors.disk_tier import DiskTier
from tests.connector.test_disk_tier import FP, KEY, features

CAP = 1 << 20


def head(header: DiskHeader, key: bytes = KEY, magic: bytes = MAGIC, length: int | None = None) -> bytes:
    """The prefix and header as the format says (docs/ARCHITECTURE.md), with any magic, length or key."""
    body = msgspec.msgpack.encode(header)
    n = len(body) if length is None else length
    mac = hashlib.blake2b(magic + n.to_bytes(4, "little") + body, digest_size=16, key=key,
                          person=b"epd-disk-header").digest()
    return struct.pack("<8sI16s", magic, n, mac) + body


def parts(mm_hash: str, key: bytes = KEY, fp: str = FP) -> tuple[DiskHeader, bytes]:
    """A whole file's header and payload for `mm_hash`."""
    whole = b"".join(bytes(memoryview(p).cast("B")) for p in encode_file(fp, mm_hash, features(7), key))
    n = struct.unpack("<8sI", whole[:12])[1]
    return msgspec.msgpack.decode(whole[28:28 + n], type=DiskHeader), whole[28 + n:]


def good(mm_hash: str) -> bytes:
    header, payload = parts(mm_hash)
    return head(header) + payload


def _resized(mm_hash: str, **changes: object) -> bytes:
    header, payload = parts(mm_hash)
    return head(msgspec.structs.replace(header, item=msgspec.structs.replace(header.item, **changes))) + payload


def _other_payload(mm_hash: str) -> bytes:
    """Another embedding's payload, of the same size: a genuine header's item served with other content."""
    whole = b"".join(bytes(memoryview(p).cast("B")) for p in encode_file(FP, mm_hash, features(8), KEY))
    return whole[-len(parts(mm_hash)[1]):]


def _payload_bytes(mm_hash: str, delta: int) -> bytes:
    header, payload = parts(mm_hash)
    return head(msgspec.structs.replace(header, payload_bytes=header.payload_bytes + delta)) + payload


# defect -> (the file for item `defect`, the reason it must be refused for)
DEFECTS: dict[str, tuple[Callable[[str], bytes], str]] = {
    "short-prefix": (lambda h: good(h)[:20], "shorter than the 28-byte prefix"),
    "magic": (lambda h: head(parts(h)[0], magic=b"EPDEMB\x00\x01") + parts(h)[1], "magic"),
    "header-length": (lambda h: head(parts(h)[0], length=1 << 30) + parts(h)[1], r"header of 1073741824 bytes"),
    "forged-mac": (lambda h: head(parts(h)[0], key=b"") + parts(h)[1], "header MAC does not match"),
    "other-key": (lambda h: head(parts(h)[0], key=file_key("another fleet")) + parts(h)[1],
                  "header MAC does not match"),
    "garbage-header": (lambda h: head(msgspec.structs.replace(parts(h)[0], payload_bytes=-1)) + parts(h)[1],
                       "bad header"),
    "altered-header": (lambda h: head(parts(h)[0], key=KEY).replace(b"model-a", b"model-b") + parts(h)[1],
                    "header MAC does not match"),
    "other-fingerprint": (lambda h: head(parts(h, fp="model-b")[0]) + parts(h)[1], "model fingerprint"),
    "declared-size": (lambda h: _payload_bytes(h, 2), "declares"),
    "over-cap": (lambda h: _resized(h, shape=[CAP, 16]), "over the"),
    "one-byte-more": (lambda h: good(h) + b"\x00", "the file holds .* bytes after the header, not the"),
    "one-byte-less": (lambda h: good(h)[:-1], "the file holds .* bytes after the header, not the"),
}


def _refusal(path: Path, fp: str = FP) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        header, start = read_header(fd, os.fstat(fd).st_size, fp, CAP, KEY)
        read_features(fd, header, start, KEY)
    except DiskFormatError as e:
        return str(e)
    finally:
        os.close(fd)
    return "accepted"


def test_the_spec_helper_writes_what_the_tier_writes() -> None:
    header, payload = parts("x")
    assert head(header) + payload == good("x") == b"".join(
        bytes(memoryview(p).cast("B")) for p in encode_file(FP, "x", features(7), KEY))
    assert encode_head(header, KEY) == head(header)


@pytest.mark.parametrize("defect", DEFECTS)
def test_a_file_with_one_defect_is_refused_for_that_defect(tmp_path: Path, defect: str) -> None:
    make, reason = DEFECTS[defect]
    path = tmp_path / file_name(defect)
    path.write_bytes(make(defect))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(DiskFormatError, match=reason):
            read_header(fd, os.fstat(fd).st_size, FP, CAP, KEY)
    finally:
        os.close(fd)


def test_the_one_defect_files_are_whole_files_but_for_it(tmp_path: Path) -> None:
    """The control: the same builders without a defect make a file both checks accept."""
    path = tmp_path / file_name("fine")
    path.write_bytes(good("fine"))
    assert _refusal(path) == "accepted"


@pytest.mark.parametrize(("defect", "make", "reason"), [
    ("flipped-payload", lambda h: good(h)[:-1] + bytes([good(h)[-1] ^ 1]), "does not match its digest"),
    ("swapped-payload", lambda h: head(parts(h)[0]) + _other_payload(h), "does not match its digest"),
])
def test_a_payload_that_is_not_the_headers_is_refused_when_read(tmp_path: Path, defect: str,
                                                                make: Callable[[str], bytes], reason: str) -> None:
    path = tmp_path / file_name(defect)
    path.write_bytes(make(defect))
    assert re.search(reason, _refusal(path)), _refusal(path)


@pytest.fixture
def tier_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], str]]:
    """Index a folder holding every one-defect file; the log of its start."""
    opened: list[DiskTier] = []

    def start() -> str:
        with caplog.at_level(logging.WARNING, logger="epd.connector"):
            opened.append(DiskTier(tmp_path, CAP, FP, key=KEY))
        assert opened[0].hashes() == []
        return caplog.text
    yield start
    for tier in opened:
        tier.close()


def test_the_tier_skips_each_file_for_its_own_reason(tmp_path: Path, tier_log: Callable[[], str]) -> None:
    (tmp_path / FP).mkdir(mode=0o700)
    for defect, (make, _) in DEFECTS.items():
        (tmp_path / FP / file_name(defect)).write_bytes(make(defect))
    log = tier_log()
    for defect, (_, reason) in DEFECTS.items():
        line = next(ln for ln in log.splitlines() if file_name(defect) in ln)
        assert re.search(reason, line), (defect, line)
