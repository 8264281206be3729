"""A producer with a disk tier: what only the disk holds is advertised, answered and served; a restarted producer
serves what it wrote before; and the bytes stored but not yet gathered are counted until gathered or aged out."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from connector.control.cache_index import FleetCacheIndex
from connector.tensors.consumer import ECConsumer
from connector.tensors.disk_format import file_key
from connector.tensors.disk_tier import DiskTier
from connector.tensors.producer import ECProducer
from epd_contracts.embeddings import ImageFeatures
from tests.decoder_service.engine_run import wait_until

GUARD_S = 10.0  # upper bound on any wait here; never reached when things work
ITEM_BYTES = 4 * 8 * 4  # output(): 4 rows of 8 float32


def output(seed: int) -> ImageFeatures:
    return ImageFeatures(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)), (1, 2, 2))


@pytest.fixture
def index() -> Iterator[FleetCacheIndex]:
    idx = FleetCacheIndex()
    yield idx
    idx.close()


@pytest.fixture
def consumer() -> Iterator[ECConsumer]:
    c = ECConsumer(cache_bytes=0)  # no consumer-side cache: every gather asks the producer
    yield c
    c.close()


def start(folder: Path, memory_items: int = 2, disk_bytes: int = 1 << 20, shm: bool = False,
          max_age_s: float = 60.0, **kw: int) -> ECProducer:
    return ECProducer(cache_bytes=memory_items * ITEM_BYTES, shm=shm, shm_min_bytes=0,
                      disk=DiskTier(folder, disk_bytes, "fp", key=file_key("internal key")), ungathered_max_age_s=max_age_s, **kw).start()


def saved(producer: ECProducer, n: int) -> dict[str, ImageFeatures]:
    items = {f"h{i}": output(i) for i in range(n)}
    for h, f in items.items():
        producer.save_caches(h, f)
    assert producer.disk is not None and producer.disk.flush(GUARD_S)
    return items


def follow(index: FleetCacheIndex, producer: ECProducer) -> None:
    index.add(producer.address, producer.events_address)
    assert index.wait_for(lambda: index.has_seen(producer.address, *producer.position()), GUARD_S)


def test_items_past_memory_stay_advertised_and_are_served_from_disk(
        tmp_path: Path, index: FleetCacheIndex, consumer: ECConsumer) -> None:
    producer = start(tmp_path)
    try:
        items = saved(producer, 5)  # memory holds 2: h0..h2 were evicted from it, never from the disk
        assert producer.stats()["num_items"] == 2 and producer.stats()["disk_items"] == 5
        follow(index, producer)
        assert all(index.has_cache_item(h) for h in items)  # no "evicted" event, and the snapshot lists the disk
        assert consumer.query(producer.address, list(items)) == [True] * 5
        got = consumer.gather(list(items), dict.fromkeys(items, producer.address), timeout=GUARD_S)
        assert all(torch.equal(got[h].embeds, f.embeds) and got[h].grid_thw == f.grid_thw for h, f in items.items())
        assert producer.stats()["disk_hits"] >= 3
    finally:
        producer.close()


def test_one_get_reads_no_more_disk_items_than_one_reply_sends(tmp_path: Path, consumer: ECConsumer) -> None:
    producer = start(tmp_path, memory_items=1, max_reply_bytes=ITEM_BYTES)  # one item a reply
    try:
        items = saved(producer, 4)  # memory keeps h3; h0..h2 only on disk
        gets_before = producer.stats()["gets_served"]
        got = consumer.gather(list(items), dict.fromkeys(items, producer.address), timeout=GUARD_S)
        assert all(torch.equal(got[h].embeds, f.embeds) for h, f in items.items())
        # the disk items came a reply at a time (`more`), each read once, none read and then dropped unsent
        assert producer.stats()["gets_served"] - gets_before == 4 and producer.stats()["disk_hits"] == 3
    finally:
        producer.close()


def test_an_item_the_disk_evicts_and_memory_lacks_is_announced_evicted(tmp_path: Path, index: FleetCacheIndex) -> None:
    probe = start(tmp_path / "probe")
    saved(probe, 1)
    file_bytes = probe.stats()["disk_bytes"]
    probe.close()
    producer = start(tmp_path / "dir", memory_items=1, disk_bytes=2 * file_bytes)  # two files fit
    try:
        follow(index, producer)
        saved(producer, 3)  # the disk drops h0, which memory dropped before
        assert index.wait_for(lambda: index.has_seen(producer.address, *producer.position()), GUARD_S)
        assert [index.has_cache_item(f"h{i}") for i in range(3)] == [False, True, True]
    finally:
        producer.close()


@pytest.mark.parametrize("shm", [False, True], ids=["socket", "shm"])
def test_a_restarted_producer_serves_what_it_wrote(tmp_path: Path, index: FleetCacheIndex, shm: bool) -> None:
    before = start(tmp_path, shm=shm)
    items = saved(before, 3)
    before.close()
    after = start(tmp_path, shm=shm)
    consumer = ECConsumer(cache_bytes=0, shm=shm)
    try:
        follow(index, after)
        assert all(index.has_cache_item(h) for h in items) and all(after.has_cache_item(h) for h in items)
        got = consumer.gather(list(items), dict.fromkeys(items, after.address), timeout=GUARD_S)
        assert all(torch.equal(got[h].embeds, f.embeds) for h, f in items.items())
        assert after.stats()["disk_hits"] == 3 and after.stats()["disk_writes"] == 0
        held = after.get_cache_item("h0")  # the encoder's own path (has, then get) reads it back too
        assert held is not None and torch.equal(held.embeds, items["h0"].embeds)
    finally:
        consumer.close()
        after.close()


def test_stored_bytes_count_until_gathered(tmp_path: Path, consumer: ECConsumer) -> None:
    producer = start(tmp_path, memory_items=4)
    try:
        saved(producer, 2)
        assert producer.ungathered_bytes() == 2 * ITEM_BYTES
        consumer.gather(["h0"], {"h0": producer.address}, timeout=GUARD_S)
        assert producer.ungathered_bytes() == ITEM_BYTES
    finally:
        producer.close()


def test_stored_bytes_nobody_gathers_age_out(tmp_path: Path) -> None:
    producer = start(tmp_path, memory_items=4, max_age_s=0.0)  # counted for no time at all
    try:
        saved(producer, 2)
        assert producer.ungathered_bytes() == 0 and producer.stats()["ungathered_aged_out"] == 2
    finally:
        producer.close()


def test_stored_bytes_evicted_before_anyone_gathered_them_stop_counting() -> None:
    """An item the cache evicted can never be gathered: it must not hold admission shut (no disk tier here)."""
    producer = ECProducer(cache_bytes=ITEM_BYTES, shm=False).start()  # room for one item
    try:
        producer.save_caches("h0", output(0))
        producer.save_caches("h1", output(1))  # evicts h0
        assert wait_until(lambda: producer.ungathered_bytes() == ITEM_BYTES)
    finally:
        producer.close()
