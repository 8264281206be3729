"""A process of the same user against the shared-memory segments: sealed once filled, checked before use.

Segments are reachable by any process of the encoder's user through `/proc/<encoder>/fd/<n>`. Once an item is
held, none of them can change its bytes (which every consumer, by mapping or by socket, would receive); a write
that lands before the seal is caught; a consumer trusts only a segment that is sealed against writes; a handle
that does not describe its segment exactly is refused, and the item travels by socket.
"""
from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence

import pytest
import torch

from connector.tensors import shm
from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from connector.tensors.replies import read_get_reply
from connector.tensors.shm import Segment, ShmError, open_handle
from epd_contracts.ec import SHM_TAG_BYTES, GetItem, GetReply, ShmHandle
from epd_contracts.embeddings import ImageFeatures

GUARD_S = 10.0

# every way to change a file's bytes through a path, tried by another process of the same user
_ATTACKER = textwrap.dedent("""
    import ctypes, fcntl, json, mmap, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fd = os.open(sys.argv[1], os.O_RDWR)  # opening succeeds: the seals refuse what comes next

    def punch_hole():  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE: would zero the pages under every mapping
        if libc.fallocate(fd, 3, 0, 4096) != 0:
            raise OSError(ctypes.get_errno(), "fallocate")

    def errno_of(attempt):
        try:
            attempt()
        except OSError as e:
            return e.errno
        return 0

    print(json.dumps({
        "write": errno_of(lambda: os.pwrite(fd, b"evil" * 64, 16)),
        "shared writable mapping": errno_of(lambda: mmap.mmap(fd, 0)),
        "punch hole": errno_of(punch_hole),
        "truncate": errno_of(lambda: os.ftruncate(fd, 0)),
        "another seal": errno_of(lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)),
    }), flush=True)
""")


def features(seed: int = 0) -> ImageFeatures:
    g = torch.Generator().manual_seed(seed)
    return ImageFeatures(torch.randn(64, 64, generator=g).to(torch.bfloat16), grid_thw=(1, 8, 8))


@pytest.fixture
def producer() -> Iterator[ECProducer]:
    p = ECProducer(shm_min_bytes=0).start()
    yield p
    p.close()


def gather_both_ways(producer: ECProducer) -> tuple[ImageFeatures, ImageFeatures, dict[str, int]]:
    """Item "a" gathered by a consumer that maps it and by one that takes the socket, and the first one's stats."""
    mapped, by_socket = ECConsumer(cache_bytes=0), ECConsumer(cache_bytes=0, shm=False)
    try:
        src = {"a": producer.address}
        return mapped.gather(["a"], src, GUARD_S)["a"], by_socket.gather(["a"], src, GUARD_S)["a"], mapped.stats()
    finally:
        mapped.close()
        by_socket.close()


def test_another_process_of_the_same_user_cannot_change_a_held_item(producer: ECProducer) -> None:
    sent = features()
    producer.save_caches("a", sent)
    handle = gather_handle(producer)
    run = subprocess.run([sys.executable, "-c", _ATTACKER, f"/proc/{handle.pid}/fd/{handle.fd}"],
                         capture_output=True, text=True, timeout=GUARD_S * 6, check=True)
    assert json.loads(run.stdout) == dict.fromkeys(
        ["write", "shared writable mapping", "punch hole", "truncate", "another seal"], errno.EPERM)
    mapped, by_socket, stats = gather_both_ways(producer)
    assert stats["shm_items_received"] == 1  # the sealed segment is trusted
    assert torch.equal(mapped.embeds, sent.embeds) and torch.equal(by_socket.embeds, sent.embeds)


def test_the_producer_cannot_write_its_own_segment_either() -> None:
    segment = Segment(4096, [torch.ones(1024)])
    try:
        assert segment.fd is not None
        path = f"/proc/self/fd/{segment.fd}"
        fd = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", SHM_TAG_BYTES)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, segment.size)  # MAP_SHARED, read-write
        finally:
            os.close(fd)
        seals = fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS)
        assert seals & shm.REQUIRED_SEALS == shm.REQUIRED_SEALS and seals & fcntl.F_SEAL_SEAL
        segment.tensor(0, torch.float32, (1024,))[0] = 5.0  # its own views are copy-on-write
        reader = open_handle(segment.handle(), os.getpid(), 4096)
        assert torch.equal(shm.mapped_tensor(reader, 0, "float32", [1024]), torch.ones(1024))  # what was sealed
    finally:
        segment.close()


def test_a_writer_mapping_made_before_the_seal_keeps_the_item_off_shared_memory(
        producer: ECProducer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel refuses the write seal (EBUSY) while another writable mapping exists: the item stays on the heap."""
    intruders: list[mmap.mmap] = []
    real_fill = shm._fill

    def fill_with_an_intruder(fd: int, size: int, tag: bytes, contents: Sequence[torch.Tensor]) -> None:
        real_fill(fd, size, tag, contents)
        other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # as a process of the same user would, before the seal
        intruders.append(mmap.mmap(other, size))
        os.close(other)

    monkeypatch.setattr(shm, "_fill", fill_with_an_intruder)
    sent = features()
    producer.save_caches("a", sent)
    monkeypatch.undo()
    assert intruders and producer.stats()["shm_place_failures"] == 1
    intruders[0][SHM_TAG_BYTES:SHM_TAG_BYTES + 4] = b"evil"  # the intruder writes: nobody reads that segment
    mapped, by_socket, stats = gather_both_ways(producer)
    assert stats["socket_items_received"] == 1 and stats["shm_items_received"] == 0
    assert torch.equal(mapped.embeds, sent.embeds) and torch.equal(by_socket.embeds, sent.embeds)
    intruders[0].close()


def test_a_write_that_lands_before_the_seal_is_caught(producer: ECProducer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write(2) between the fill and the seal leaves no mapping behind; the check of the sealed bytes catches it."""
    real_fill = shm._fill

    def fill_then_overwrite(fd: int, size: int, tag: bytes, contents: Sequence[torch.Tensor]) -> None:
        real_fill(fd, size, tag, contents)
        other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        os.pwrite(other, b"evil", SHM_TAG_BYTES)
        os.close(other)

    monkeypatch.setattr(shm, "_fill", fill_then_overwrite)
    sent = features()
    producer.save_caches("a", sent)
    monkeypatch.undo()
    assert producer.stats()["shm_place_failures"] == 1 and producer.stats()["shm_items_placed"] == 0
    mapped, by_socket, _ = gather_both_ways(producer)
    assert torch.equal(mapped.embeds, sent.embeds) and torch.equal(by_socket.embeds, sent.embeds)


def test_a_segment_without_the_write_seal_is_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer that seals only the size (as before the write seal) is asked by socket: the probe fails."""
    monkeypatch.setattr(shm, "FILLED_SEALS", fcntl.F_SEAL_SEAL)
    weak = Segment(64)
    weak_producer = ECProducer(shm_min_bytes=0).start()
    sent = features()
    weak_producer.save_caches("a", sent)
    monkeypatch.undo()
    try:
        assert weak.fd is not None and not fcntl.fcntl(weak.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE
        with pytest.raises(ShmError, match="not sealed against writes"):
            open_handle(weak.handle(), os.getpid(), 64)
        mapped, by_socket, stats = gather_both_ways(weak_producer)
        assert stats["shm_probes"] == 1 and stats["shm_producers"] == 0 and stats["socket_items_received"] == 1
        assert torch.equal(mapped.embeds, sent.embeds) and torch.equal(by_socket.embeds, sent.embeds)
    finally:
        weak_producer.close()
        weak.close()


@pytest.mark.parametrize("segment_bytes", [64, 256])
def test_a_handle_sized_for_the_item_but_not_its_segment_is_refused(segment_bytes: int) -> None:
    """The handle's size is the item's (16 + 128 bytes), the segment it names is smaller or larger: refused, never
    mapped (smaller: mmap would raise ValueError; larger: its tag matches, and the item's bytes would be a prefix)."""
    segment = Segment(segment_bytes)
    try:
        assert segment.fd is not None
        handle = ShmHandle(pid=os.getpid(), fd=segment.fd, tag=segment.tag, size=SHM_TAG_BYTES + 128)
        with pytest.raises(ShmError, match="segment has"):
            open_handle(handle, os.getpid(), 128)
        item = GetItem(mm_hash="a", found=True, num_tokens=4, dtype="bfloat16", shape=[4, 16], shm=handle)
        found, unmapped = read_get_reply(GetReply(req_id=1, items=[item]), [], os.getpid())
        assert not found and "segment has" in unmapped["a"]  # asked again by socket
    finally:
        segment.close()


def test_a_gather_whose_handle_names_a_smaller_segment_falls_back_to_the_socket(
        producer: ECProducer, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = producer._shm_probe  # a sealed 16-byte segment of the same producer, with a tag of its own
    assert probe is not None and probe.fd is not None
    monkeypatch.setattr(Segment, "handle", lambda self: ShmHandle(
        pid=os.getpid(), fd=probe.fd if self is not probe else self.fd, tag=probe.tag, size=self.size))
    sent = features()
    producer.save_caches("a", sent)
    mapped, _, stats = gather_both_ways(producer)
    assert torch.equal(mapped.embeds, sent.embeds)
    assert stats["shm_fallbacks"] == 1 and stats["socket_items_received"] == 1 and stats["shm_items_received"] == 0


def gather_handle(producer: ECProducer) -> ShmHandle:
    """The handle a get answers item "a" with (what a consumer, or anyone reading its socket, learns)."""
    held = producer._cache.get("a")
    assert held is not None and held.segment is not None
    return held.segment.handle()
