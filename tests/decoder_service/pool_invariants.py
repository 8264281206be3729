"""The K/V pool's invariants (decoder_service/engine/block_manager.py), checked after every engine step of the
decoder tests (conftest.py): no referenced block is evictable; free and evictable blocks are disjoint, unreferenced
and, with the referenced ones, every usable block; each block's references equal how many rows' block tables (and
fork reservations) name it.

A CPU test pool has ~10^6 blocks, so the check after a step (`full=False`) looks at the blocks a step can touch:
the referenced and evictable ones and the top of the free stack (where every release lands, and every allocation
takes from); the whole pool is checked when the test ends (`full=True`)."""
from __future__ import annotations

from collections import Counter

from decoder_service.engine.block_manager import BlockManager
from decoder_service.engine.model_runner import ModelRunner

FREE_TOP = 4096  # free blocks checked after each step: the top of the stack


def block_violations(blocks: BlockManager, held: Counter[int], full: bool = True) -> list[str]:
    """What is wrong with the pool, given each block's holders (`held`)."""
    out: list[str] = []
    free = blocks.free if full else blocks.free[-FREE_TOP:]
    free_set, evictable = set(free), blocks.evictable
    if len(free_set) != len(free):
        out.append("a block is free twice")
    if both := [b for b in evictable if b in free_set]:
        out.append(f"blocks both free and evictable: {both[:8]}")
    if 0 in free_set or 0 in evictable or 0 in held:
        out.append("the null block is allocatable or held")
    if bad := [b for b in evictable if blocks.refs[b] or b in held]:
        out.append(f"referenced blocks are evictable: {bad[:8]}")
    if bad := [b for b in free if blocks.refs[b] or b in held]:
        out.append(f"referenced blocks are free: {bad[:8]}")
    if bad := [b for b in evictable if b not in blocks.key_of]:
        out.append(f"evictable blocks the prefix cache does not name: {bad[:8]}")
    if bad := [b for b in held if blocks.refs[b] != held[b]]:
        out.append("references differ from the block tables: " +
                   ", ".join(f"block {b}: {blocks.refs[b]} refs, {held[b]} holders" for b in bad[:8]))
    if len(held) + len(blocks.free) + len(evictable) != blocks.num_usable:
        out.append(f"{len(held)} held + {len(blocks.free)} free + {len(evictable)} evictable blocks != "
                   f"{blocks.num_usable} usable")
    if full and (stray := len(blocks.refs) - blocks.refs.count(0) - len(held)):
        out.append(f"{stray} referenced blocks no block table names")
    return out


def pool_violations(runner: ModelRunner, full: bool = True) -> list[str]:
    """The runner's pool against its rows' block tables."""
    held: Counter[int] = Counter()
    for row in list(runner.rows.values()):
        held.update(row.blocks)
        held.update(row.fork_blocks)
    return block_violations(runner.blocks, held, full)
