"""Rows on the paged K/V pool: each row's block table, taken at admission (the cached prefix by reference, the rest
allocated), grown as its decode crosses a block boundary, named in the prefix cache, forked for n > 1, given back.

Blocks (decoder_service/engine/block_manager.py): a row takes its prompt's blocks at admission, one more each time
its decode crosses a block boundary (`grow`, which the scheduler makes room for by preempting), and gives them back
on `remove`. A completed prompt names its full blocks in the prefix cache; a finishing (or preempted) row names the
blocks of the tokens it fed back too.

n > 1 (one prompt, n choices): the prompt is prefilled once; its forks then share every full block of it and get a
copy of the last, partial one (reserved at admission), each a row of its own from then on, all starting from the
same last-position logits.

Preempted rows come back with the tokens they had fed (`add(..., fed=...)`): prefilled again (mostly from the prefix
cache they named on the way out), then they decode on from their pending token; their recomputed logits are dropped.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch

from decoder_service.engine.block_manager import BlockManager
from decoder_service.engine.kv_blocks import import_blocks
from decoder_service.engine.kv_cache import PagedCache
from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.prefix_hash import PrefixChain
from decoder_service.engine.step_inputs import Row
from decoder_service.engine.work import Prompt
from epd_models.halves import LanguageHalf


class RowTable:
    """Rows by key in admission order, on one pool of blocks; the model runner (model_runner.py) runs their steps."""

    def __init__(self, lm: LanguageHalf, max_slots: int, max_len: int, prefix_bytes: int = 0, prefix_block: int = 16,
                 num_blocks: int | None = None):
        self.lm, self.max_slots, self.max_len = lm, max_slots, max_len
        self.block_size = b = prefix_block
        dtype = next(lm.module.parameters()).dtype
        self.shape = KVShape.of(lm.config.get_text_config(), dtype, lm.tp_size)  # this rank's share of the K/V
        self.wire_shape = KVShape.of(lm.config.get_text_config(), dtype)  # every head's: what a hand-off carries
        if num_blocks is None:  # as many as max_slots sequences of max_len need
            num_blocks = max_slots * -(-max_len // b) + 1
        self.cache = PagedCache(self.shape, num_blocks, b, lm.device)
        if lm.ranks is not None:  # tensor parallelism: every rank's pool mirrors this one's blocks
            self.cache.mirror = lm.ranks.open_pool(num_blocks, b)
        block_bytes = self.shape.bytes_per_block(b)
        self.blocks = BlockManager(num_blocks, b, block_bytes, caching=prefix_bytes > 0,
                                   cache_cap=prefix_bytes // block_bytes if prefix_bytes > 0 else None)
        self.prefix = self.blocks if prefix_bytes > 0 else None
        self.rows: dict[Hashable, Row] = {}
        self._fresh: list[int] = []  # blocks allocated since the last forward: zeroed before it
        self._forked: dict[Hashable, list[Hashable]] = {}  # this step: prompt row -> the forks made from it

    # -- capacity -------------------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        """Rows a step may still take (the max_num_seqs bound), forks reserved included."""
        return self.max_slots - len(self.rows) - sum(len(r.forks) for r in self.rows.values())

    @property
    def is_full(self) -> bool:
        return self.num_free_slots <= 0

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def num_prefill_tokens_left(self) -> int:
        return sum(r.target - r.length for r in self.rows.values() if not r.prefilled)

    def blocks_to_admit(self, num_tokens: int, n: int, chain: PrefixChain | None) -> int:
        """Blocks an admission of a prompt of `num_tokens` with `n` choices takes now (its cached prefix is free)."""
        b = self.block_size
        held = len(self.blocks.match(chain.keys)) if chain is not None and self.prefix is not None else 0
        held = min(held, (num_tokens - 1) // b)
        forks = (n - 1) if num_tokens % b else 0
        return -(-num_tokens // b) - held + forks

    def blocks_to_grow(self, keys: Iterable[Hashable]) -> int:
        """New blocks the next decode step of these rows needs (each row crossing into a new block)."""
        return sum(1 for k in keys if (r := self.rows[k]).length // self.block_size >= len(r.blocks))

    def is_decoding(self, key: Hashable) -> bool:
        row = self.rows.get(key)
        return row is not None and row.prefilled

    # -- rows -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, key: Hashable, prompt: Prompt, forks: Iterable[Hashable] = (), chain: PrefixChain | None = None,
            route_keys: Iterable[str] = (), fed: Sequence[int] | None = None) -> int:
        """A row for `prompt`; with `fed` (maybe empty), a preempted row coming back with the tokens it had fed: its
        prefill's last logits are not a new token's. With `forks`, that many more rows copy its K/V once prefilled.
        Returns the positions taken from the prefix cache (not prefilled)."""
        resumed, fed = fed is not None, tuple(fed or ())
        forks = list(forks)
        assert self.num_free_slots >= 1 + len(forks), "no free row"
        target = prompt.num_tokens + len(fed)
        assert target < self.max_len, "prompt does not fit the context"
        positions, delta = self.lm.position_ids(prompt.input_ids, prompt.images)
        embeds = self.lm.embed(prompt.input_ids, prompt.images)
        if fed:
            ids = torch.tensor([list(fed)])
            embeds = torch.cat([embeds, self.lm.embed(ids, [])], dim=1)
            extra = [self.lm.adapter.decode_position_ids(prompt.num_tokens + i, delta) for i in range(len(fed))]
            positions = torch.cat([positions, self.lm.to_device(torch.cat(extra, dim=-1))], dim=-1)
        state = self.lm.prefill_state(prompt.input_ids, prompt.images)
        chain = chain if self.prefix is not None else None
        row = Row(key, prompt, embeds, positions, delta, target, state, forks=forks, chain=chain,
                  route_keys=tuple(route_keys), fed=fed, resumed=resumed)
        keys = (chain.extend(fed) if fed else chain.keys) if chain is not None else ()
        shared = self._reusable(row, keys)
        need = -(-target // self.block_size) - len(shared)
        fork_need = len(forks) if target % self.block_size else 0
        self.blocks.acquire(shared)  # before allocating: the match must not be evicted by it
        try:
            fresh = self.blocks.allocate(need + fork_need)
        except Exception:
            self.blocks.release(shared)
            raise
        self._fresh += fresh
        row.blocks, row.fork_blocks = shared + fresh[:need], fresh[need:]
        row.length = len(shared) * self.block_size
        if self.prefix is not None and not resumed:
            self.blocks.record(row.length)
        self.rows[key] = row
        return row.length

    @torch.inference_mode()
    def add_prefilled(self, key: Hashable, prompt: Prompt, kv: torch.Tensor, chain: PrefixChain | None = None,
                      route_keys: Iterable[str] = (), first_block: int = 0) -> None:
        """A row whose prompt another worker prefilled (E -> P -> D): its first `first_block` blocks are the prefix
        cache's (by reference), the rest taken and filled with `kv` (checked: decoder_service/engine/kv_blocks.py),
        so it decodes from its first token on with no prefill here. ValueError if the cache dropped that prefix."""
        assert self.num_free_slots >= 1, "no free row"
        target = prompt.num_tokens
        assert target < self.max_len, "prompt does not fit the context"
        chain = chain if self.prefix is not None else None
        shared = self.blocks.match(chain.keys[:first_block]) if chain is not None and first_block else []
        if len(shared) != first_block:
            raise ValueError(f"the prefix cache no longer holds the prompt's first {first_block} blocks")
        positions, delta = self.lm.position_ids(prompt.input_ids, prompt.images)  # M-RoPE: the decode positions' delta
        row = Row(key, prompt, positions.new_empty((1, 0, 0), dtype=torch.float32), positions, delta, target,
                  chain=chain, route_keys=tuple(route_keys))
        self.blocks.acquire(shared)  # before allocating: the match must not be evicted by it
        try:
            fresh = self.blocks.allocate(-(-target // self.block_size) - len(shared))
        except Exception:
            self.blocks.release(shared)
            raise
        row.blocks = shared + fresh
        try:  # every position of the fresh blocks written: not zeroed again
            import_blocks(self.cache, fresh, kv, first_block * self.block_size, target)
        except Exception:
            self.blocks.release(row.blocks)
            raise
        row.length = target
        if chain is not None:
            self._name(row, chain.keys)
        self.rows[key] = row

    def _reusable(self, row: Row, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks the row starts from: the longest match, leaving the last position to compute (its
        logits start decoding), and never ending inside what the family prefills whole (Gemma 3's images)."""
        if not keys:
            return []
        b = self.block_size
        held = self.blocks.match(keys)[: (row.target - 1) // b]
        n = len(held)
        while n > 0:
            end = self.lm.adapter.chunk_end(row.state, 0, n * b)
            if end == n * b:
                break
            n = end // b
        return held[:n]

    def remove(self, key: Hashable) -> None:
        """Give a row's blocks back (or, for a fork not made yet, its reservation)."""
        row = self.rows.pop(key, None)
        if row is None:
            for r in self.rows.values():
                if key in r.forks:
                    r.forks.remove(key)
                    if r.fork_blocks:
                        self.blocks.release([r.fork_blocks.pop()])
            return
        self.blocks.release(row.fork_blocks)
        self.blocks.release(row.blocks)

    def donate(self, key: Hashable, generated: list[int]) -> None:
        """A finishing (or preempted) row names the full blocks of its prompt and of the tokens it fed back."""
        row = self.rows.get(key)
        if self.prefix is None or row is None or row.chain is None or not row.prefilled:
            return
        fed = row.length - row.prompt.num_tokens
        self._name(row, row.chain.extend(generated[:fed]))

    def _name(self, row: Row, keys: Sequence[bytes]) -> None:
        full = min(len(keys), row.length // self.block_size)
        held = self.blocks.register(row.blocks[:full], keys[:full])
        if held and row.route_keys:
            self.blocks.note_routes(row.route_keys, keys[held - 1])

    def grow(self, keys: Iterable[Hashable]) -> None:
        """A block for each row whose next position starts one (the scheduler made room)."""
        for k in keys:
            row = self.rows[k]
            if row.length // self.block_size >= len(row.blocks):
                block = self.blocks.allocate(1)
                self._fresh += block
                row.blocks += block

    def blocks_to_cover(self, key: Hashable, positions: int) -> int:
        """Blocks the row lacks for its first `positions` positions (speculative decoding's drafts)."""
        return max(0, -(-positions // self.block_size) - len(self.rows[key].blocks))

    def cover(self, key: Hashable, positions: int) -> int:
        """Take the blocks the row lacks for its first `positions` positions; returns how many."""
        need = self.blocks_to_cover(key, positions)
        if need:
            fresh = self.blocks.allocate(need)
            self._fresh += fresh
            self.rows[key].blocks += fresh
        return need

    def _prompt_done(self, row: Row) -> None:
        """A prompt just completed: name its blocks, make its forks, release what prefill alone needed."""
        if row.chain is not None:
            self._name(row, row.chain.extend(row.fed) if row.fed else row.chain.keys)
        self._fork(row)
        full, empty = row.embeds, row.embeds[:, :0]
        for r in self.rows.values():  # K x N x hidden per image, held for as long as the row runs
            if r.embeds is full:
                r.embeds, r.state = empty, None

    def _fork(self, row: Row) -> None:
        """Each fork shares the prompt's full blocks and gets a copy of its last, partial one."""
        if not row.forks:
            return
        full = row.length // self.block_size
        made: list[Hashable] = []
        for i, key in enumerate(row.forks):
            blocks = row.blocks[:full]
            self.blocks.acquire(blocks)
            if row.fork_blocks:
                own = row.fork_blocks[i]
                self.cache.copy_block(row.blocks[full], own)
                blocks = blocks + [own]
            self.rows[key] = Row(key, row.prompt, row.embeds, row.positions, row.rope_delta, row.target, None,
                                 row.length, blocks, chain=row.chain, route_keys=row.route_keys)
            made.append(key)
        row.forks, row.fork_blocks = [], []
        self._forked[row.key] = made
