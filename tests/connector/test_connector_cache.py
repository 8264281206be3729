"""EmbeddingCache: byte bound, LRU order and counters."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from connector.tensors.cache import EmbeddingCache
from epd_contracts.embeddings import ImageFeatures

GUARD_S = 10.0  # upper bound on any wait in these tests; never reached when things work


def make_output(num_tokens: int = 4, hidden: int = 8) -> ImageFeatures:
    """A float32 output of num_tokens * hidden * 4 bytes."""
    return ImageFeatures(torch.zeros(num_tokens, hidden))


def test_put_and_get_count_hits_and_misses() -> None:
    cache: EmbeddingCache[ImageFeatures] = EmbeddingCache(max_bytes=1024)
    out = make_output()
    assert cache.put("a", out)
    assert cache.get("a") is out and cache.get("b") is None
    assert "a" in cache and len(cache) == 1
    assert cache.stats() == {"num_items": 1, "bytes": 128, "max_bytes": 1024, "hits": 1, "misses": 1, "evictions": 0,
                             "rejected": 0, "pinned": 0, "pin_waits": 0}


def test_byte_bound_is_respected_and_evictions_counted() -> None:
    cache: EmbeddingCache[ImageFeatures] = EmbeddingCache(max_bytes=300)  # room for two 128-byte items
    for name in "abcd":
        assert cache.put(name, make_output())
        assert cache.nbytes <= 300
    assert len(cache) == 2 and cache.stats()["evictions"] == 2
    assert "c" in cache and "d" in cache


def test_least_recently_used_item_is_evicted_first() -> None:
    cache: EmbeddingCache[ImageFeatures] = EmbeddingCache(max_bytes=3 * 128)
    for name in "abc":
        cache.put(name, make_output())
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("d", make_output())
    assert "b" not in cache
    assert all(name in cache for name in "acd")


def test_item_larger_than_the_bound_is_not_stored() -> None:
    cache: EmbeddingCache[ImageFeatures] = EmbeddingCache(max_bytes=100)
    assert cache.put("small", make_output(num_tokens=1))
    assert not cache.put("huge", make_output(num_tokens=100))
    assert "huge" not in cache and "small" in cache and cache.stats()["evictions"] == 0


def test_replacing_an_item_updates_its_bytes() -> None:
    cache: EmbeddingCache[ImageFeatures] = EmbeddingCache(max_bytes=1024)
    cache.put("a", make_output(num_tokens=4))
    cache.put("a", make_output(num_tokens=2))
    assert len(cache) == 1 and cache.nbytes == 64


def test_pinned_item_is_not_evicted_and_a_put_that_cannot_fit_is_refused() -> None:
    cache: EmbeddingCache[ImageFeatures] = EmbeddingCache(max_bytes=256)  # room for two 128-byte items
    a, b, c = make_output(), make_output(), make_output()
    assert cache.put("a", a) and cache.put("b", b)
    with cache.pinned(["a", "b"]) as held:
        assert set(held) == {"a", "b"}
        assert not cache.put("c", c)  # everything is pinned: refused, nothing evicted
        assert "a" in cache and "b" in cache and cache.stats()["rejected"] == 1
    with cache.pinned(["a"]):
        assert cache.put("c", c)  # the unpinned one goes
    assert "a" in cache and "b" not in cache and "c" in cache
    assert cache.stats()["evictions"] == 1 and cache.stats()["pinned"] == 0


def test_a_put_waits_for_a_pin_to_be_released() -> None:
    cache: EmbeddingCache[ImageFeatures] = EmbeddingCache(max_bytes=128)  # room for one item
    assert cache.put("a", make_output())
    done: list[bool] = []
    keys = ["a"]
    cache.pin(keys)  # as a producer's serving thread holds an item while it hands a reply to ZeroMQ
    saver = threading.Thread(target=lambda: done.append(cache.put("b", make_output(), wait_s=GUARD_S)))
    saver.start()
    wait_until(lambda: cache.stats()["pin_waits"] == 1)  # the put found no room and is waiting
    assert not done and "a" in cache and "b" not in cache
    cache.unpin(keys)
    saver.join(GUARD_S)
    assert done == [True] and "b" in cache and "a" not in cache and cache.stats()["rejected"] == 0


def test_a_put_waits_for_pins_only_as_long_as_it_is_told() -> None:
    cache: EmbeddingCache[ImageFeatures] = EmbeddingCache(max_bytes=128)
    assert cache.put("a", make_output())
    with cache.pinned(["a"]):
        assert not cache.put("b", make_output(), wait_s=0.01)  # a pin that never goes: refused once the wait ends
        assert not cache.put("huge", make_output(num_tokens=100), wait_s=GUARD_S)  # larger than the cache: no wait
    stats = cache.stats()
    assert stats["rejected"] == 2 and stats["pin_waits"] == 1 and "a" in cache


def wait_until(condition: Callable[[], bool]) -> None:
    """Wait for `condition` (another thread's progress); GUARD_S is never reached when things work."""
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_journal_records_every_store_and_eviction_in_sequence() -> None:
    cache: EmbeddingCache[ImageFeatures] = EmbeddingCache(max_bytes=256, journal=True)
    for h in "abc":
        cache.put(h, make_output())
    assert cache.drain_events() == [(1, "stored", "a"), (2, "stored", "b"), (3, "evicted", "a"), (4, "stored", "c")]
    assert cache.drain_events() == []
    assert cache.snapshot() == (4, ["b", "c"])
