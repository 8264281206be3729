"""A prefill worker's hand-offs leave its store once their decode worker has them (`kv_release`), and otherwise at
their TTL on the K/V server's timer, not at the next hand-off (when they waited for it, 187 MB of memfd were held 90 s
after the last request with a 30 s TTL). No fixed sleep: the store's clock is injected, and each wait is for the event,
with a deadline."""

from __future__ import annotations

import pytest
import torch

from connector.tensors.errors import KVUnavailable
from connector.tensors.kv_client import KVClient
from connector.tensors.kv_store import KVStore
from tests.connector.kv_factories import BLOCKS, CHOICES, GUARD_S, LAYOUT, NUM_TOKENS, serving
from tests.waiting import wait_for


@pytest.mark.parametrize("shm", [True, False], ids=["by handle", "by frames"])
def test_a_fetch_that_releases_frees_the_entry_at_once(client: KVClient, shm: bool) -> None:
    store = KVStore(1 << 20, 60.0, shm=shm, shm_min_bytes=0)
    store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    with serving(store) as server:
        got = client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S, release=True)
        stats = store.stats()
        assert (stats["items"], stats["bytes"], stats["released"], stats["expired"]) == (0, 0, 1, 0)
        assert server.stats()["kv_releases"] == 1 and client.stats()["releases"] == 1
        assert got.shm == shm and torch.equal(got.blocks, BLOCKS)  # its copy, or its own mapping, outlives the entry
        with pytest.raises(KVUnavailable, match="not found"):  # asked again: the decode worker would prefill
            client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
    store.close()


def test_a_fetch_without_release_leaves_the_entry_for_a_retry(client: KVClient) -> None:
    store = KVStore(1 << 20, 60.0)
    store.put("k", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    with serving(store) as server:
        client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
        assert store.stats()["items"] == 1 and server.stats()["kv_releases"] == 0
    store.close()


def test_a_release_nobody_answers_is_counted_not_raised(client: KVClient) -> None:
    store = KVStore(1 << 20, 60.0)
    with serving(store) as server:
        address = server.address
    assert client.release(address, "k", timeout=0.2) is False  # the server is gone: its TTL frees the blocks
    assert client.stats()["release_failures"] == 1


def test_the_server_expires_entries_on_a_timer_with_nothing_asked() -> None:
    now = [100.0]
    store = KVStore(1 << 20, ttl_s=30.0, clock=lambda: now[0])
    with serving(store) as server:
        store.put("old", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
        now[0] = 110.0
        store.put("new", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
        assert store.stats()["items"] == 2  # reading the stats frees nothing
        now[0] = 130.0  # "old" is due; no request, no put follows
        wait_for(lambda: store.stats()["items"] == 1, "the timer freed the expired hand-off", GUARD_S)
        assert store.stats()["expired"] == 1 and store.get("new") is not None
        now[0] = 140.0
        wait_for(lambda: store.stats()["bytes"] == 0, "the timer freed the last hand-off", GUARD_S)
        assert server.stats()["kv_gets_served"] == 0
    store.close()


def test_expire_says_when_the_next_entry_is_due() -> None:
    now = [0.0]
    store = KVStore(1 << 20, ttl_s=30.0, clock=lambda: now[0])
    assert store.expire() is None
    store.put("a", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    now[0] = 10.0
    store.put("b", LAYOUT, NUM_TOKENS, BLOCKS, CHOICES)
    assert store.expire() == 20.0
    now[0] = 35.0
    assert store.expire() == 5.0 and store.stats()["items"] == 1
    assert store.release("b") and not store.release("b") and store.expire() is None
    assert store.stats()["released"] == 1
