"""K/V hand-offs through same-host shared memory: the decode worker maps the prefill worker's sealed segment, and
every handle that cannot be mapped falls back to the socket in the same fetch."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq

from connector.control.wire import WireError, decode_message, encode_message
from connector.tensors import shm
from connector.tensors.errors import KVUnavailable
from connector.tensors.frames import tensor_buffer
from connector.tensors.kv_client import KVClient
from connector.tensors.kv_store import KVStore
from connector.tensors.shm import Segment, ShmError, open_handle
from epd_contracts.ec import SHM_TAG_BYTES, ShmHandle
from epd_contracts.kv import KVGetReply, KVGetRequest
from tests.connector.kv_factories import (
    BLOCKS,
    CHOICES,
    GUARD_S,
    LAYOUT,
    NUM_TOKENS,
    fake_producer,
    make_blocks,
    serving,
)


def shm_store(**kwargs: Any) -> KVStore:
    """A store that holds every hand-off in shared memory, however small (the tests' blocks are 512 bytes)."""
    return KVStore(kwargs.pop("max_bytes", 1 << 20), kwargs.pop("ttl_s", 60.0), shm_min_bytes=0, **kwargs)


def in_mapping(t: torch.Tensor) -> bool:
    """Whether `t`'s bytes lie in a copy-on-write mapping of an epd-ec memfd segment of this process."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5].startswith(f"/memfd:{shm.NAME}") and parts[1].startswith("rw-p"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr and ptr + t.nbytes <= hi:
                return True
    return False


def segment_inodes() -> set[int]:
    """Inodes of the epd-ec segments this process holds an fd of (/proc/self/fd)."""
    inodes = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, gone by now
            if os.readlink(f"/proc/self/fd/{name}").startswith(f"/memfd:{shm.NAME}"):
                inodes.add(os.stat(f"/proc/self/fd/{name}").st_ino)
    return inodes


def honest(request: KVGetRequest, blocks: torch.Tensor = BLOCKS, handle: ShmHandle | None = None) -> list[Any]:
    """A fake server's reply to `request`: by `handle` when asked with shm and given one, else by frames."""
    header = KVGetReply(req_id=request.req_id, key=request.key, found=True, layout=request.layout,
                        num_tokens=NUM_TOKENS, num_blocks=blocks.shape[0], first_block=request.first_block,
                        choices=CHOICES, shm=handle if request.shm else None)
    frames = [] if header.shm is not None else [tensor_buffer(b) for b in blocks[request.first_block:]]
    return encode_message(header, frames)


@contextlib.contextmanager
def fake_with_probe(answer: Callable[[KVGetRequest], list[Any]]) -> Iterator[str]:
    """A fake server in this process whose probe segment clients can map, so they ask it with shm."""
    probe = Segment(0)
    try:
        with fake_producer(answer, probe.handle()) as address:
            yield address
    finally:
        probe.close()


# by handle


def test_a_same_host_fetch_maps_the_blocks_and_sends_no_frame(client: KVClient) -> None:
    store = shm_store()
    assert store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    held = store.get("k")
    assert held is not None and held.shm is not None and in_mapping(held.blocks)  # placed once, viewed there
    with serving(store) as server:
        got = client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
        stats = server.stats()
    assert torch.equal(got.blocks, BLOCKS) and got.choices == CHOICES
    assert (got.num_tokens, got.num_blocks, got.first_block) == (NUM_TOKENS, 3, 0)
    assert in_mapping(got.blocks) and got.blocks.data_ptr() != held.blocks.data_ptr()  # its own mapping: no copy
    assert stats["bytes_sent"] == 0 and stats["blocks_sent"] == 0 and stats["shm_probes"] == 1
    assert stats["shm_gets_served"] == 1 and stats["shm_bytes_served"] == BLOCKS.nbytes
    assert client.stats() == {"shm_fetches": 1, "socket_fetches": 0, "shm_fallbacks": 0, "shm_probes": 1,
                              "releases": 0, "release_failures": 0, "shm_producers": 1}
    got.blocks[0, 0, 0, 0, 0, 0] = 1234.0  # copy on write: the write stays in the decode worker
    assert torch.equal(held.blocks, BLOCKS)
    store.close()


def test_a_shm_get_is_answered_with_a_handle_and_no_frame() -> None:
    store = shm_store()
    store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    with serving(store) as server:
        dealer: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(server.address)
        try:
            replies = []
            for ask in (True, False):
                dealer.send_multipart(encode_message(KVGetRequest(req_id=1, key="k", layout=LAYOUT, shm=ask)))
                assert dealer.poll(int(GUARD_S * 1000)), "the KV server did not answer"
                replies.append(dealer.recv_multipart())
        finally:
            dealer.close()
    (by_handle, no_frames), (by_frames, frames) = (decode_message(r, max_frames=8) for r in replies)
    assert isinstance(by_handle, KVGetReply) and by_handle.shm is not None and no_frames == []
    assert len(replies[0]) == 1 and by_handle.shm.size == SHM_TAG_BYTES + BLOCKS.nbytes
    assert isinstance(by_frames, KVGetReply) and by_frames.shm is None and len(frames) == 3
    store.close()


def test_first_block_by_handle_maps_only_the_rest(client: KVClient) -> None:
    blocks = make_blocks(LAYOUT, 16)  # 4 full blocks
    store = shm_store()
    store.put("k", LAYOUT, 16, blocks, CHOICES)
    with serving(store) as server:
        got = client.fetch(server.address, "k", LAYOUT, first_block=3, timeout=GUARD_S)
        stats = server.stats()
    assert got.first_block == 3 and got.num_blocks == 4 and torch.equal(got.blocks, blocks[3:])
    assert in_mapping(got.blocks) and stats["bytes_sent"] == 0
    assert stats["shm_blocks_served"] == 1 and stats["shm_bytes_served"] == blocks[0].nbytes
    store.close()


def test_a_reply_by_handle_over_the_consumers_byte_limit_is_refused() -> None:
    """The consumer's cap holds for blocks it would map, as for frames: the handle is never opened."""
    store = shm_store()
    store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    block = BLOCKS[0].nbytes
    small = KVClient(max_reply_bytes=2 * block)  # two of the three blocks
    try:
        with serving(store) as server:
            with pytest.raises(KVUnavailable, match=f"{3 * block} bytes of blocks, over the {2 * block}-byte cap"):
                small.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
            got = small.fetch(server.address, "k", LAYOUT, first_block=1, timeout=GUARD_S)
            assert server.stats()["shm_gets_served"] == 2 and server.stats()["bytes_sent"] == 0  # both by handle
        assert got.shm and torch.equal(got.blocks, BLOCKS[1:])
        assert small.stats()["shm_fetches"] == 1 and small.stats()["shm_fallbacks"] == 0  # refused, not retried
    finally:
        small.close()
        store.close()


def test_a_fetched_tensor_outlives_the_entry(client: KVClient) -> None:
    store = shm_store()
    store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    with serving(store) as server:
        got = client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
    store.drop("k")
    store.close()
    gc.collect()
    assert torch.equal(got.blocks, BLOCKS)  # the decode worker's mapping keeps the pages


# falling back to the socket


def test_a_segment_closed_before_the_map_falls_back_to_the_socket_in_the_same_fetch(client: KVClient) -> None:
    store = shm_store()
    store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    held = store.get("k")
    assert held is not None and held.segment is not None
    held.segment.close()  # as if freed between the reply and the map: the handle names a closed fd
    with serving(store) as server:
        got = client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
        assert torch.equal(got.blocks, BLOCKS) and not in_mapping(got.blocks)
        assert client.stats()["shm_fallbacks"] == 1 and client.stats()["socket_fetches"] == 1
        assert server.stats()["bytes_sent"] == BLOCKS.nbytes
        client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)  # that server gets frames until a retry is due
        assert client.stats()["shm_probes"] == 1 and client.stats()["socket_fetches"] == 2
        assert server.stats()["shm_gets_served"] == 1 and client.stats()["shm_producers"] == 0
    store.close()


@pytest.mark.parametrize("forge", ["closed fd", "wrong tag", "wrong size", "another pid", "a pipe"])
def test_a_forged_handle_falls_back_to_the_socket(client: KVClient, forge: str) -> None:
    real = Segment(BLOCKS.nbytes, [BLOCKS])
    r, w = os.pipe()
    good = real.handle()
    forged = {
        "closed fd": ShmHandle(pid=good.pid, fd=1 << 20, tag=good.tag, size=good.size),
        "wrong tag": ShmHandle(pid=good.pid, fd=good.fd, tag=bytes(SHM_TAG_BYTES), size=good.size),
        "wrong size": ShmHandle(pid=good.pid, fd=good.fd, tag=good.tag, size=good.size - BLOCKS[0].nbytes),
        "another pid": ShmHandle(pid=1, fd=good.fd, tag=good.tag, size=good.size),
        "a pipe": ShmHandle(pid=good.pid, fd=r, tag=good.tag, size=good.size),
    }[forge]
    try:
        with fake_with_probe(lambda request: honest(request, handle=forged)) as address:
            got = client.fetch(address, "k", LAYOUT, timeout=GUARD_S)
    finally:
        os.close(r)
        os.close(w)
        real.close()
    assert torch.equal(got.blocks, BLOCKS) and not in_mapping(got.blocks)
    assert client.stats()["shm_fallbacks"] == 1 and client.stats()["socket_fetches"] == 1


def test_a_stale_handle_never_reads_another_entrys_bytes(client: KVClient) -> None:
    """A's handle after A was freed and its fd number went to B's segment (of the same size): the tag refuses it."""
    store = shm_store()
    other = make_blocks(LAYOUT, NUM_TOKENS)
    store.put("a", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    store.put("b", LAYOUT, NUM_TOKENS, other, CHOICES)
    a, b = store.get("a"), store.get("b")
    assert a is not None and a.shm is not None and b is not None and b.shm is not None
    stale = ShmHandle(pid=a.shm.pid, fd=b.shm.fd, tag=a.shm.tag, size=a.shm.size)
    with pytest.raises(ShmError, match="tag"):
        open_handle(stale, os.getpid(), BLOCKS.nbytes)
    with fake_with_probe(lambda request: honest(request, handle=stale)) as address:
        got = client.fetch(address, "a", LAYOUT, timeout=GUARD_S)
    assert torch.equal(got.blocks, BLOCKS) and not torch.equal(got.blocks, other)  # A's, by socket
    assert client.stats()["shm_fallbacks"] == 1
    store.close()


def test_a_handle_not_asked_for_is_refused() -> None:
    real = Segment(BLOCKS.nbytes, [BLOCKS])
    client = KVClient(shm=False)
    try:
        with fake_producer(lambda request: honest(msgspec.structs.replace(request, shm=True),
                                                       handle=real.handle())) as address, \
                pytest.raises(KVUnavailable, match="did not ask for"):
            client.fetch(address, "k", LAYOUT, timeout=GUARD_S)
    finally:
        client.close()
        real.close()


def test_the_wire_refuses_a_handle_with_frames_or_without_blocks() -> None:
    handle = ShmHandle(pid=os.getpid(), fd=3, tag=bytes(SHM_TAG_BYTES), size=SHM_TAG_BYTES + BLOCKS.nbytes)
    found = KVGetReply(req_id=1, key="k", found=True, layout=LAYOUT, num_tokens=NUM_TOKENS, num_blocks=3,
                       choices=CHOICES, shm=handle)
    assert decode_message(encode_message(found))[1] == []
    with pytest.raises(WireError, match="by shared-memory handle has 1 frame"):
        decode_message(encode_message(found, [tensor_buffer(BLOCKS[0])]))
    with pytest.raises(WireError, match="a handle"):
        decode_message(encode_message(KVGetReply(req_id=1, key="k", error="gone", shm=handle)))


@pytest.mark.parametrize("side", ["server", "client"])
def test_the_off_flag_on_either_side_sends_frames(side: str) -> None:
    store = KVStore(1 << 20, 60, shm=side != "server", shm_min_bytes=0)
    client = KVClient(shm=side != "client")
    store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    try:
        with serving(store) as server:
            got = client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
            stats = server.stats()
        assert store.stats()["shm"] == (side != "server")
    finally:
        client.close()
        store.close()
    assert torch.equal(got.blocks, BLOCKS) and not in_mapping(got.blocks)
    assert stats["bytes_sent"] == BLOCKS.nbytes and stats["shm_gets_served"] == 0
    assert stats["shm_probes"] == (1 if side == "server" else 0)


def test_small_hand_offs_stay_on_the_heap(client: KVClient) -> None:
    store = KVStore(1 << 20, 60, shm_min_bytes=BLOCKS.nbytes + 1)
    store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    held = store.get("k")
    assert held is not None and held.segment is None and held.blocks is BLOCKS  # kept, not copied
    with serving(store) as server:
        assert torch.equal(client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S).blocks, BLOCKS)
        assert server.stats()["bytes_sent"] == BLOCKS.nbytes
    assert client.stats()["shm_producers"] == 1  # verified: it would map a larger one
    store.close()


def test_an_allocation_failure_holds_the_hand_off_on_the_heap(client: KVClient,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    store = shm_store()
    gc.collect()
    before = segment_inodes()
    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    assert store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    assert segment_inodes() == before  # the failed segment's fd was closed
    assert store.stats()["shm_place_failures"] == 1 and store.stats()["shm_placed"] == 0
    with serving(store) as server:
        assert torch.equal(client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S).blocks, BLOCKS)
        assert server.stats()["bytes_sent"] == BLOCKS.nbytes
    store.close()


# freeing


@pytest.mark.parametrize("how", ["evicted", "expired", "dropped", "replaced", "closed"])
def test_freeing_an_entry_closes_its_segment_fd(how: str) -> None:
    now = [0.0]
    gc.collect()
    before = segment_inodes()
    store = shm_store(max_bytes=BLOCKS.nbytes, ttl_s=5.0, clock=lambda: now[0])  # room for one hand-off
    store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    held = store.get("k")
    assert held is not None and held.segment is not None and held.segment.fd is not None
    segment, inode = held.segment, os.fstat(held.segment.fd).st_ino
    # NOTE: the segment's fd, and the one mmap keeps (a dup) while its mapping lives: a view of it keeps that open
    del held
    assert inode in segment_inodes() - before
    free: dict[str, Callable[[], object]] = {
        "evicted": lambda: store.put("other", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES),
        "expired": lambda: (now.__setitem__(0, 5.0), store.expire()),
        "dropped": lambda: store.drop("k"),
        "replaced": lambda: store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES),
        "closed": store.close,
    }
    free[how]()
    assert segment.fd is None and inode not in segment_inodes()
    store.close()
    assert segment_inodes() == before  # the probe's and every entry's fd: none left open


# values


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_in_shared_memory_are_refused(client: KVClient, value: float) -> None:
    blocks = BLOCKS.clone()
    blocks[1, 1, 0, 1, 2, 3] = value
    store = shm_store()
    store.put("k", LAYOUT, NUM_TOKENS, blocks, CHOICES)  # a prefill worker that wrote them: the decode side refuses
    with serving(store) as server:
        with pytest.raises(KVUnavailable, match="block 1 has non-finite"):
            client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
        assert server.stats()["bytes_sent"] == 0 and client.stats()["shm_fallbacks"] == 0  # refused, not retried
    store.close()
