"""The CPU K/V pool is a reserve the kernel does not charge up front: a process holding pools as large as RAM can
still fork (its workers, a subprocess), and the pool's pages are touched only as blocks are used."""
from __future__ import annotations

import os

import torch

from decoder_service.engine.kv_cache import PagedCache
from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.memory_plan import cpu_total_bytes


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_pools_as_large_as_ram_are_not_committed_and_the_process_still_forks() -> None:
    shape = KVShape(num_layers=4, kv_heads=4, head_dim=64, dtype=torch.float32)
    block = shape.bytes_per_block(16)
    before = _rss_bytes()
    caches = [PagedCache(shape, cpu_total_bytes() // block, 16) for _ in range(2)]  # twice the RAM in all
    assert sum(c.nbytes for c in caches) >= 2 * cpu_total_bytes() - 2 * block
    caches[0].zero([1, 2, 3])
    assert _rss_bytes() - before < 256 << 20  # untouched blocks cost nothing
    pid = os.fork()  # Linux's heuristic overcommit refused this when the pools came from torch.empty
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def test_freed_blocks_are_reused_first_so_the_touched_pool_stays_at_the_peak() -> None:
    """Sequences coming and going never walk the pool: over 200 rounds of 8 sequences of 5 blocks, the blocks ever
    handed out are the 40 the peak needs (a queue of free blocks would have handed out all 4,095, and on the CPU
    committed every page of them)."""
    from decoder_service.engine.block_manager import BlockManager

    bm = BlockManager(4096, 16, 1024, caching=False)
    seen: set[int] = set()
    for _ in range(200):
        held = [bm.allocate(5) for _ in range(8)]
        seen.update(b for blocks in held for b in blocks)
        for blocks in reversed(held):
            bm.release(blocks)
    assert len(seen) == 40 and bm.num_free == 4095
