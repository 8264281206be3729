"""Same-host shared memory: gathers map the producer's memfd segments, and every failure falls back to the socket."""
from __future__ import annotations

import contextlib
import errno
import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from connector.control.security import CurveConfig
from connector.tensors import shm
from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from connector.tensors.replies import read_get_reply
from connector.tensors.shm import Segment, ShmError, open_handle
from epd_contracts.ec import SHM_TAG_BYTES, GetItem, GetReply, ShmHandle
from epd_contracts.embeddings import ImageFeatures

GUARD_S = 10.0
ROOT = Path(__file__).resolve().parents[2]


def features(tokens: int = 6, hidden: int = 16, layers: int = 0, seed: int = 0) -> ImageFeatures:
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    deep = torch.randn(layers, tokens, hidden, generator=g).to(torch.bfloat16) if layers else None
    return ImageFeatures(embeds, grid_thw=(1, 2, 3), span=(7, 8) if layers else None, deepstack=deep)


def memfd_ranges(pid: int | str = "self", mode: str = "") -> list[tuple[int, int]]:
    """Address ranges of the process's `memfd:epd-ec` mappings (`mode`: only those whose permissions start so)."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5].startswith(f"/memfd:{shm.NAME}") and parts[1].startswith(mode):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi))
    return out


def mapped_inodes(pid: int | str = "self") -> set[int]:
    """Inodes of the epd-ec segments the process maps."""
    lines = (line.split() for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    return {int(parts[4]) for parts in lines if len(parts) >= 6 and parts[5].startswith(f"/memfd:{shm.NAME}")}


def in_mapping(t: torch.Tensor, mode: str) -> bool:
    ptr = t.data_ptr()
    return any(lo <= ptr and ptr + t.nbytes <= hi for lo, hi in memfd_ranges(mode=mode))


@pytest.fixture
def pair() -> Iterator[tuple[ECProducer, ECConsumer]]:
    producer, consumer = ECProducer(shm_min_bytes=0).start(), ECConsumer(cache_bytes=0)
    yield producer, consumer
    consumer.close()
    producer.close()


@pytest.mark.parametrize("layers", [0, 3])
def test_gather_over_shm_equals_gather_over_socket(pair: tuple[ECProducer, ECConsumer], layers: int) -> None:
    producer, consumer = pair
    socket_consumer = ECConsumer(cache_bytes=0, shm=False)
    try:
        sent = features(layers=layers)
        producer.save_caches("a", sent)
        by_shm = consumer.gather(["a"], {"a": producer.address}, GUARD_S)["a"]
        by_socket = socket_consumer.gather(["a"], {"a": producer.address}, GUARD_S)["a"]
    finally:
        socket_consumer.close()
    for got in (by_shm, by_socket):
        assert got.embeds.dtype == sent.embeds.dtype and torch.equal(got.embeds, sent.embeds)
        assert got.grid_thw == sent.grid_thw and got.span == sent.span
        assert (got.deepstack is None) == (sent.deepstack is None)
        if sent.deepstack is not None:
            assert got.deepstack is not None and torch.equal(got.deepstack, sent.deepstack)
    stats, served = consumer.stats(), producer.stats()
    assert stats["shm_items_received"] == 1 and stats["shm_bytes_received"] == sent.nbytes
    assert stats["socket_items_received"] == 0 and stats["shm_producers"] == 1
    assert served["shm_items_served"] == 1 and served["socket_items_served"] == 1  # one each way
    assert served["bytes_sent"] == sum(t.nbytes for t in (sent.embeds, sent.deepstack) if t is not None)


def test_the_consumer_maps_the_producer_segment_without_a_copy(pair: tuple[ECProducer, ECConsumer]) -> None:
    producer, consumer = pair
    producer.save_caches("a", features(tokens=512, hidden=1024, layers=2))  # 1 MiB + 2 MiB
    held = producer.get_cache_item("a")
    assert held is not None and in_mapping(held.embeds, "rw-p")  # placed once in the sealed segment, viewed copy-on-write
    got = consumer.gather(["a"], {"a": producer.address}, GUARD_S)["a"]
    assert got.deepstack is not None
    assert in_mapping(got.embeds, "rw-p") and in_mapping(got.deepstack, "rw-p")  # a private, copy-on-write mapping
    got.embeds[0, 0] = 1234.0  # writable, and the write stays in the consumer
    assert held.embeds[0, 0] != got.embeds[0, 0]


def test_a_handle_that_fails_to_open_falls_back_to_the_socket_in_the_same_gather(
        pair: tuple[ECProducer, ECConsumer], monkeypatch: pytest.MonkeyPatch) -> None:
    producer, consumer = pair
    sent = features()
    producer.save_caches("a", sent)
    producer.save_caches("b", features(seed=1))
    consumer.gather(["b"], {"b": producer.address}, GUARD_S)  # probed and mapped once
    real = Segment.handle

    def closed_fd(self: Segment) -> ShmHandle:  # as if the producer had evicted the item after answering
        h = real(self)
        return ShmHandle(pid=h.pid, fd=(1 << 20), tag=h.tag, size=h.size)

    monkeypatch.setattr(Segment, "handle", closed_fd)
    got = consumer.gather(["a"], {"a": producer.address}, GUARD_S)["a"]
    assert torch.equal(got.embeds, sent.embeds)
    stats = consumer.stats()
    assert stats["shm_fallbacks"] == 1 and stats["socket_items_received"] == 1 and stats["shm_producers"] == 0
    monkeypatch.setattr(Segment, "handle", real)
    consumer.gather(["a"], {"a": producer.address}, GUARD_S)  # the failed address is not asked for handles again
    assert consumer.stats()["socket_items_received"] == 2 and consumer.stats()["shm_probes"] == 1


def test_a_probe_naming_a_process_this_consumer_cannot_see_keeps_the_socket(
        pair: tuple[ECProducer, ECConsumer], monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer in another pid namespace names a pid that is not its own here: the probe fails, the get goes by
    socket, and no handle is ever asked for."""
    producer, consumer = pair
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    real = Segment.handle
    try:
        monkeypatch.setattr(Segment, "handle", lambda self: ShmHandle(
            pid=other.pid, fd=real(self).fd, tag=self.tag, size=self.size))
        sent = features()
        producer.save_caches("a", sent)
        assert torch.equal(consumer.gather(["a"], {"a": producer.address}, GUARD_S)["a"].embeds, sent.embeds)
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=GUARD_S)
    stats = consumer.stats()
    assert stats["shm_probes"] == 1 and stats["shm_producers"] == 0 and stats["socket_items_received"] == 1
    assert producer.stats()["shm_items_served"] == 0


def test_a_stale_handle_is_refused_by_its_tag() -> None:
    old = Segment(64)
    stale = old.handle()
    old.close()
    new = Segment(64)  # the lowest free fd: the one the evicted segment had
    try:
        assert new.fd == stale.fd
        with pytest.raises(ShmError, match="tag"):
            open_handle(stale, os.getpid(), 64)
        open_handle(new.handle(), os.getpid(), 64).close()
    finally:
        new.close()


def test_hostile_handles_are_refused_without_harm() -> None:
    seg = Segment(64)
    r, w = os.pipe()  # a FIFO would block an open: it is refused before any open
    try:
        good = seg.handle()
        me = os.getpid()
        hostile = {
            "another pid": ShmHandle(pid=1, fd=good.fd, tag=good.tag, size=good.size),
            "fd 0": ShmHandle(pid=me, fd=0, tag=good.tag, size=good.size),
            "a pipe": ShmHandle(pid=me, fd=r, tag=good.tag, size=good.size),
            "huge size": ShmHandle(pid=me, fd=good.fd, tag=good.tag, size=1 << 40),
            "wrong tag": ShmHandle(pid=me, fd=good.fd, tag=bytes(SHM_TAG_BYTES), size=good.size),
            "closed fd": ShmHandle(pid=me, fd=(1 << 20), tag=good.tag, size=good.size),
        }
        for why, handle in hostile.items():
            with pytest.raises(ShmError):
                open_handle(handle, me, 64)
            # in a reply: that item is unmapped (asked again by socket), the reply and the consumer live on
            item = GetItem(mm_hash=why, found=True, num_tokens=2, dtype="bfloat16", shape=[2, 16], shm=handle)
            found, unmapped = read_get_reply(GetReply(req_id=1, items=[item]), [], me)
            assert not found and why in unmapped
        # a declared shape far larger than the segment, and a handle from a producer never probed
        item = GetItem(mm_hash="big", found=True, num_tokens=1 << 20, dtype="float32", shape=[1 << 20, 1 << 20],
                       shm=good)
        assert "big" in read_get_reply(GetReply(req_id=1, items=[item]), [], me)[1]
        item = GetItem(mm_hash="x", found=True, num_tokens=2, dtype="bfloat16", shape=[2, 16], shm=good)
        assert "x" in read_get_reply(GetReply(req_id=1, items=[item]), [], None)[1]
    finally:
        os.close(r)
        os.close(w)
        seg.close()


def test_small_items_stay_on_the_heap_and_go_by_socket() -> None:
    producer = ECProducer(shm_min_bytes=1 << 10).start()
    consumer = ECConsumer(cache_bytes=0)
    try:
        small, big = features(tokens=2), features(tokens=64)  # 64 and 2048 bytes
        producer.save_caches("small", small)
        producer.save_caches("big", big)
        received: dict[str, int] = {}
        got = consumer.gather(["small", "big"], {"small": producer.address, "big": producer.address}, GUARD_S,
                              received=received)
        assert torch.equal(got["small"].embeds, small.embeds) and torch.equal(got["big"].embeds, big.embeds)
        assert received == {"shm": big.nbytes, "socket": small.nbytes}  # what a trace's `gather` span says
        stats = consumer.stats()
        assert stats["shm_items_received"] == 1 and stats["socket_items_received"] == 1
        assert producer.stats()["shm_items_placed"] == 1
    finally:
        consumer.close()
        producer.close()


def test_allocation_failure_holds_the_item_on_the_heap(pair: tuple[ECProducer, ECConsumer],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    producer, consumer = pair

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    sent = features()
    producer.save_caches("a", sent)
    assert len(os.listdir("/proc/self/fd")) == before  # the failed segment's fd was closed
    assert torch.equal(consumer.gather(["a"], {"a": producer.address}, GUARD_S)["a"].embeds, sent.embeds)
    assert producer.stats()["shm_place_failures"] == 1 and producer.stats()["socket_items_served"] == 1
    assert consumer.stats()["socket_items_received"] == 1


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_the_off_flag_keeps_the_socket(side: str) -> None:
    producer = ECProducer(shm=side != "producer", shm_min_bytes=0).start()
    consumer = ECConsumer(cache_bytes=0, shm=side != "consumer")
    try:
        sent = features()
        producer.save_caches("a", sent)
        assert torch.equal(consumer.gather(["a"], {"a": producer.address}, GUARD_S)["a"].embeds, sent.embeds)
        stats = consumer.stats()
        assert stats["socket_items_received"] == 1 and stats["shm_items_received"] == 0
        assert producer.stats()["shm_probes"] == (1 if side == "producer" else 0)
        assert producer.stats()["shm"] == (side != "producer")
    finally:
        consumer.close()
        producer.close()


def test_eviction_closes_the_segment_fd_and_the_consumer_keeps_its_pages() -> None:
    sent = features(tokens=64, hidden=64)
    # room for one item; the serving thread may still pin "a" when the gather returns: the save of "b" waits for
    # that pin to go (GUARD_S is never reached when things work)
    producer = ECProducer(cache_bytes=sent.nbytes, shm_min_bytes=0, pin_wait_s=GUARD_S).start()
    consumer = ECConsumer(cache_bytes=0)
    try:
        producer.save_caches("a", sent)
        held = producer._cache.get("a")  # the producer's own item, to name its segment's fd
        assert held is not None and held.segment is not None and held.segment.fd is not None
        fd, inode = held.segment.fd, os.fstat(held.segment.fd).st_ino
        del held
        got = consumer.gather(["a"], {"a": producer.address}, GUARD_S)["a"]
        producer.save_caches("b", features(tokens=64, hidden=64, seed=1))  # evicts "a"
        assert not producer.has_cache_item("a") and producer.has_cache_item("b")
        with contextlib.suppress(FileNotFoundError):  # closed, or reused since by another file ("b"'s segment)
            assert os.stat(f"/proc/self/fd/{fd}").st_ino != inode
        gc.collect()
        assert torch.equal(got.embeds, sent.embeds)  # the consumer's mapping keeps the evicted item's pages
        assert inode in mapped_inodes()  # (that mapping is of the segment whose fd was closed)
    finally:
        consumer.close()
        producer.close()
    del got
    gc.collect()
    assert inode not in mapped_inodes()  # its pages went once the producer closed and the consumer let go


def test_curve_secured_producer_and_consumer_still_use_shm() -> None:
    public, secret = zmq.curve_keypair()
    c_public, c_secret = zmq.curve_keypair()
    srv = CurveConfig(secret, public, allowed_clients=frozenset({c_public}))
    producer = ECProducer(curve=srv, shm_min_bytes=0).start()
    consumer = ECConsumer(cache_bytes=0, curve=CurveConfig(c_secret, c_public, server_key=public))
    try:
        sent = features()
        producer.save_caches("a", sent)
        assert torch.equal(consumer.gather(["a"], {"a": producer.address}, GUARD_S)["a"].embeds, sent.embeds)
        assert consumer.stats()["shm_items_received"] == 1
    finally:
        consumer.close()
        producer.close()
