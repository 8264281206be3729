"""The fleet cache index: built from producers' events, resynced by snapshot after gaps and restarts."""
from __future__ import annotations

import errno
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from connector.control.cache_index import FleetCacheIndex
from connector.control.hint_index import MIN_PER_PRODUCER, HintIndex, ProducerView
from connector.control.wire import decode_message, encode_message
from connector.tensors.producer import ECProducer
from epd_contracts.ec import CacheEvent, EventKind, SnapshotReply, SnapshotRequest
from epd_contracts.embeddings import ImageFeatures

GUARD_S = 10.0  # upper bound on any wait here; never reached when things work


def output(h: str, num_tokens: int = 4) -> ImageFeatures:
    return ImageFeatures(torch.ones(num_tokens, 8))  # 32 * num_tokens bytes


@pytest.fixture
def index() -> Iterator[FleetCacheIndex]:
    idx = FleetCacheIndex()
    yield idx
    idx.close()


def follow(index: FleetCacheIndex, producer: ECProducer) -> None:
    index.add(producer.address, producer.events_address)
    assert index.wait_for(lambda: index.is_synced(producer.address), GUARD_S)


def test_view_follows_stores_and_evictions(index: FleetCacheIndex) -> None:
    producer = ECProducer(cache_bytes=256).start()  # room for two items
    try:
        follow(index, producer)
        for h in "abc":
            producer.save_caches(h, output(h, 4))
        assert index.wait_for(lambda: index.has_cache_item("c") and not index.has_cache_item("a"), GUARD_S)
        assert index.holders("b") == [producer.address]
        assert index.has_seen(producer.address, *producer.position())
    finally:
        producer.close()


def test_a_late_subscriber_starts_from_a_snapshot(index: FleetCacheIndex) -> None:
    producer = ECProducer().start()
    try:
        producer.save_caches("early", output("early"))
        follow(index, producer)
        assert index.has_cache_item("early") and index.num_resyncs == 1
    finally:
        producer.close()


def test_two_indexes_share_one_view_without_a_central_store() -> None:
    producer = ECProducer().start()
    first, second = FleetCacheIndex(), FleetCacheIndex()
    try:
        follow(first, producer)
        follow(second, producer)
        producer.save_caches("x", output("x"))
        for idx in (first, second):
            assert idx.wait_for(lambda idx=idx: idx.has_cache_item("x"), GUARD_S)  # type: ignore[misc]
    finally:
        first.close()
        second.close()
        producer.close()


def restart_on(address: str, events: str) -> ECProducer:
    """A new producer on the old endpoints; ZeroMQ frees a closed listener asynchronously, so retry (bounded)."""
    deadline = time.monotonic() + GUARD_S
    while True:
        try:
            return ECProducer(bind=address, events_bind=events).start()
        except zmq.ZMQError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            threading.Event().wait(0.05)


def test_a_restarted_producer_is_a_new_epoch_and_its_old_items_are_forgotten(index: FleetCacheIndex) -> None:
    old = ECProducer().start()
    follow(index, old)
    old.save_caches("before", output("before"))
    assert index.wait_for(lambda: index.has_cache_item("before"), GUARD_S)
    address, events = old.address, old.events_address
    old.close()
    new = restart_on(address, events)  # same endpoints, empty cache
    try:
        assert new.epoch != old.epoch
        assert index.wait_for(lambda: index.has_seen(address, new.epoch, 0), GUARD_S)
        assert not index.has_cache_item("before")
    finally:
        new.close()


def test_a_silent_producer_is_forgotten() -> None:
    index = FleetCacheIndex(stale_after_s=0.5)
    producer = ECProducer().start()
    try:
        follow(index, producer)
        producer.save_caches("x", output("x"))
        assert index.wait_for(lambda: index.has_cache_item("x"), GUARD_S)
        producer.close()  # no more heartbeats
        assert index.wait_for(lambda: not index.has_cache_item("x"), GUARD_S)
    finally:
        index.close()
        producer.close()


class FakeProducer:
    """A PUB + ROUTER pair that publishes hand-made events and answers snapshots with a fixed state."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self.router, self.pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.events_address = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.snapshot: tuple[int, list[str]] = (0, [])

    def publish(self, seq: int, kind: EventKind, hashes: list[str]) -> None:
        event = CacheEvent(producer=self.address, epoch="e1", seq=seq, kind=kind, hashes=hashes)
        self.pub.send_multipart(encode_message(event))

    def answer_snapshot(self) -> None:
        assert self.router.poll(int(GUARD_S * 1000)), "no snapshot request arrived"
        identity, *request = self.router.recv_multipart()
        header, _ = decode_message(request)
        assert isinstance(header, SnapshotRequest)
        seq, hashes = self.snapshot
        reply = SnapshotReply(req_id=header.req_id, epoch="e1", seq=seq, hashes=hashes)
        self.router.send_multipart([identity, *encode_message(reply)])

    def close(self) -> None:
        self.router.close(linger=0)
        self.pub.close(linger=0)


def test_a_gap_in_the_sequence_triggers_a_resync(index: FleetCacheIndex) -> None:
    fake = FakeProducer()
    try:
        index.add(fake.address, fake.events_address)
        fake.answer_snapshot()  # initial sync: empty at seq 0
        assert index.wait_for(lambda: index.is_synced(fake.address), GUARD_S)
        # the subscription may still be connecting: repeat seq 1 (idempotent) until the index has it
        assert index.wait_for(lambda: fake.publish(1, "stored", ["a"]) or index.has_cache_item("a"), GUARD_S)
        fake.snapshot = (3, ["a", "b", "c"])
        fake.publish(3, "stored", ["c"])  # seq 2 was lost
        fake.answer_snapshot()
        assert index.wait_for(lambda: index.has_cache_item("b") and index.has_cache_item("c"), GUARD_S)
        assert index.num_resyncs == 2
    finally:
        fake.close()


def event(epoch: str, seq: int, kind: EventKind, hashes: list[str]) -> CacheEvent:
    return CacheEvent(producer="tcp://p", epoch=epoch, seq=seq, kind=kind, hashes=hashes)


def test_producer_view_applies_events_in_order_only() -> None:
    view = ProducerView("tcp://p", "tcp://p-events")
    assert not view.apply_event(event("e", 1, "stored", ["a"]))  # not synced yet
    view.apply_snapshot(SnapshotReply(req_id=1, epoch="e", seq=1, hashes=["a"]))
    assert view.apply_event(event("e", 1, "stored", ["a"]))  # already in the snapshot: ignored
    assert view.apply_event(event("e", 2, "stored", ["b"])) and set(view.held) == {"a", "b"}
    assert view.apply_event(event("e", 3, "evicted", ["a"])) and set(view.held) == {"b"}
    assert view.apply_event(event("e", 3, "heartbeat", []))
    assert not view.apply_event(event("e", 5, "stored", ["c"]))  # gap
    assert not view.apply_event(event("e", 4, "heartbeat", []))  # the heartbeat says events were missed
    assert not view.apply_event(event("other", 1, "stored", ["d"]))  # new epoch: the producer restarted


def test_a_producer_view_keeps_only_its_newest_hashes_up_to_its_cap() -> None:
    view = ProducerView("tcp://p", "tcp://p-events", cap=3)
    view.apply_snapshot(SnapshotReply(req_id=1, epoch="e", seq=1, hashes=["a", "b", "c", "d", "e"]))  # oldest first
    assert list(view.held) == ["c", "d", "e"]
    assert view.apply_event(event("e", 2, "stored", ["c", "f"]))  # c stored again: newest now, d the oldest
    assert list(view.held) == ["e", "c", "f"]


def test_the_index_shares_its_capacity_so_memory_does_not_grow_with_items() -> None:
    index = HintIndex(capacity=4 * MIN_PER_PRODUCER * 2)
    views = [ProducerView(f"tcp://p{i}", "") for i in range(4)]
    for view in views:
        index.add(view)
        view.apply_snapshot(SnapshotReply(req_id=1, epoch="e", seq=0, hashes=[]))
    assert {v.cap for v in views} == {2 * MIN_PER_PRODUCER}
    for seq in range(1, 2001):  # two thousand items stored on each: each view holds its cap, the newest
        for view in views:
            assert view.apply_event(event("e", seq, "stored", [f"h{seq}", f"{view.address}-{seq}"]))
    assert index.num_entries() == 4 * 2 * MIN_PER_PRODUCER and "tcp://p0-1" not in index.where
    assert index.holders("h2000") == [v.address for v in views] and index.holders("h1") == []
    # each keeps its newest 128: 64 shared hashes (counted once) and 64 of its own
    assert len(index.where) == MIN_PER_PRODUCER + 4 * MIN_PER_PRODUCER
    assert views[0].apply_event(event("e", 2001, "evicted", ["h2000"]))
    assert index.holders("h2000") == [v.address for v in views[1:]]
    index.remove("tcp://p1")
    assert index.holders("h2000") == ["tcp://p2", "tcp://p3"] and {v.cap for v in views[2:]} == {8 * MIN_PER_PRODUCER // 3}
    many = HintIndex(capacity=1000)
    for i in range(1000):  # fewer than the floor each: the floor
        many.add(ProducerView(f"tcp://q{i}", ""))
    assert {v.cap for v in many.views.values()} == {MIN_PER_PRODUCER}
