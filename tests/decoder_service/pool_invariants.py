"""The K/V pool's invariants (decoder_service/engine/block_manager.py), checked after every engine step of the
decoder tests (conftest.py): no referenced block is evictable; free and evictable blocks are disjoint, unreferenced
and, with the referenced ones, every usable block; each block's references equal how many rows' block tables (and
fork reservations) name it."""
from __future__ import annotations

from collections import Counter

from decoder_service.engine.block_manager import BlockManager
from decoder_service.engine.model_runner import ModelRunner


def block_violations(blocks: BlockManager, held: Counter[int] | None = None) -> list[str]:
    """What is wrong with the pool; `held`: each block's holders, when the caller knows them."""
    out: list[str] = []
    free, evictable = set(blocks.free), set(blocks.evictable)
    if len(free) != len(blocks.free):
        out.append("a block is free twice")
    if free & evictable:
        out.append(f"blocks both free and evictable: {sorted(free & evictable)[:8]}")
    if 0 in free or 0 in evictable:
        out.append("the null block is allocatable")
    if bad := [b for b in evictable if blocks.refs[b]]:
        out.append(f"referenced blocks are evictable: {bad[:8]}")
    if bad := [b for b in free if blocks.refs[b]]:
        out.append(f"referenced blocks are free: {bad[:8]}")
    if bad := [b for b in evictable if b not in blocks.key_of]:
        out.append(f"evictable blocks the prefix cache does not name: {bad[:8]}")
    referenced = sum(1 for b in range(1, blocks.num_blocks) if blocks.refs[b])
    if referenced + len(free) + len(evictable) != blocks.num_usable:
        out.append(f"{referenced} referenced + {len(free)} free + {len(evictable)} evictable blocks != "
                   f"{blocks.num_usable} usable")
    if held is not None:
        if bad := [b for b in range(1, blocks.num_blocks) if blocks.refs[b] != held[b]]:
            out.append("references differ from the block tables: " +
                       ", ".join(f"block {b}: {blocks.refs[b]} refs, {held[b]} holders" for b in bad[:8]))
    return out


def pool_violations(runner: ModelRunner) -> list[str]:
    """The runner's pool against its rows' block tables."""
    held: Counter[int] = Counter()
    for row in list(runner.rows.values()):
        held.update(row.blocks)
        held.update(row.fork_blocks)
    return block_violations(runner.blocks, held)
