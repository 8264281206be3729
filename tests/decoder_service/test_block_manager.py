"""BlockManager alone: references, the prefix cache's evictable blocks, allocation and the cap."""
from __future__ import annotations

from collections import Counter

import pytest

from decoder_service.engine.block_manager import BlockManager, NoFreeBlocks
from tests.decoder_service.pool_invariants import block_violations


def whole(bm: BlockManager, held: Counter[int]) -> None:
    assert block_violations(bm, held) == []


def cached_and_released(bm: BlockManager, key: bytes = b"k0") -> int:
    """One block named in the prefix cache, then released: cached and unreferenced (evictable)."""
    [b] = bm.allocate(1)
    assert bm.register([b], [key]) == 1
    bm.release([b])
    assert b in bm.evictable and bm.refs[b] == 0
    return b


def test_allocate_takes_free_blocks_and_release_gives_them_back() -> None:
    bm = BlockManager(5, 16, 64)
    got = bm.allocate(3)
    assert len(set(got)) == 3 and 0 not in got and bm.num_free == 1
    whole(bm, Counter(got))
    bm.release(got)
    assert bm.num_free == 4
    whole(bm, Counter())


def test_allocating_more_than_free_takes_nothing() -> None:
    bm = BlockManager(3, 16, 64)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(3)
    assert bm.num_free == 2
    whole(bm, Counter())


def test_acquiring_an_evictable_block_takes_it_out_of_the_lru() -> None:
    bm = BlockManager(4, 16, 64)
    b = cached_and_released(bm)
    bm.acquire(bm.match([b"k0"]))
    assert b not in bm.evictable and bm.refs[b] == 1
    whole(bm, Counter([b]))
    others = bm.allocate(bm.num_free)  # every other block: the held one is never handed out again
    assert b not in others and bm.by_key[b"k0"] == b
    whole(bm, Counter([b, *others]))


def test_a_released_reacquired_block_is_evictable_again_only_at_zero_references() -> None:
    bm = BlockManager(4, 16, 64)
    b = cached_and_released(bm)
    bm.acquire([b])
    bm.acquire([b])  # two holders (an n > 1 fork shares the prompt's blocks)
    bm.release([b])
    assert b not in bm.evictable and bm.refs[b] == 1
    bm.release([b])
    assert b in bm.evictable
    whole(bm, Counter())


def test_allocation_evicts_the_least_recently_released_cached_block_first() -> None:
    bm = BlockManager(3, 16, 64)
    first = cached_and_released(bm, b"a")
    second = cached_and_released(bm, b"b")
    assert bm.allocate(1) == [first] and b"a" not in bm.by_key and b"b" in bm.by_key and bm.evicted == 1
    whole(bm, Counter([first]))
    assert second in bm.evictable


def test_the_cap_frees_cached_blocks_past_it() -> None:
    bm = BlockManager(5, 16, 64, cache_cap=1)
    cached_and_released(bm, b"a")
    kept = cached_and_released(bm, b"b")
    assert list(bm.evictable) == [kept] and b"a" not in bm.by_key and bm.num_free == 4
    whole(bm, Counter())


def test_releasing_more_often_than_held_is_refused() -> None:
    bm = BlockManager(3, 16, 64)
    [b] = bm.allocate(1)
    bm.release([b])
    with pytest.raises(AssertionError, match="released more often than held"):
        bm.release([b])


def test_a_key_held_by_another_block_keeps_that_block() -> None:
    bm = BlockManager(4, 16, 64)
    one, two = bm.allocate(2)
    assert bm.register([one], [b"k"]) == 1 and bm.register([two], [b"k"]) == 1
    assert bm.by_key[b"k"] == one and two not in bm.key_of
    bm.release([one, two])
    assert one in bm.evictable and two in bm.free
    whole(bm, Counter())
