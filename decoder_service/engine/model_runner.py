"""Prefill in chunks into free slots and decode every running sequence in one batched forward.

`run(scheduled)` is one engine step's forwards: decode every prefilled row, then prefill within the budget.

n > 1 (one prompt, n choices): the prompt is prefilled once in one row; the row reserves n - 1 more slots
(`forks`), and when its last chunk completes its K/V columns are copied into them (`SlotCache.copy`), each a
row of its own from then on, all starting from the same last-position logits. Copying L columns costs a
fraction of prefilling L tokens again (epd_bench/n_prefill.py measures both).

Prefix cache (with `prefix`): `add` copies the longest cached prefix of the prompt's chain into the row's slot
and starts its prefill after it (always leaving the last prompt token to compute: its logits start decoding); a
prompt that completes gives its full blocks to the cache, and `donate` gives a finishing row's generated ones.

Fault isolation: a row whose prefill chunk raises, or whose forward fails when run alone, is reported in
`failed` (when the caller passes one) and the other rows carry on. A batched decode that raises cannot say
which row broke it, so every row is then decoded alone once (same K/V columns, written again), and only
the rows that fail alone are reported.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from decoder_service.engine.prefix_cache import PrefixCache
from decoder_service.engine.prefix_hash import PrefixChain
from decoder_service.engine.scheduler import SchedulerOutput
from decoder_service.engine.slots import Plan, SlotCache
from decoder_service.prompt import Prompt
from epd_models.halves import LanguageHalf

logger = logging.getLogger("epd.decoder")
Failed = dict[Hashable, Exception]  # row key -> what broke it


@dataclass(frozen=True)
class RunnerOutput:
    logits: dict[Hashable, torch.Tensor]  # next-token logits of every row decoded, or whose prompt is now complete
    failed: dict[Hashable, tuple[str, Exception]]  # row key -> (stage, what broke it); left in its slot


@dataclass
class Row:
    key: Hashable
    prompt: Prompt
    embeds: torch.Tensor  # (1, L, hidden) prompt embeddings, images merged
    positions: torch.Tensor  # prompt positions: (1, L), or (3, 1, L) for M-RoPE
    rope_delta: int
    state: Any = None  # the family's per-prompt prefill state (FamilyAdapter.prefill_state), None for most
    length: int = 0  # positions written into the slot
    forks: list[Hashable] = field(default_factory=list)  # keys of the rows its K/V is copied into once prefilled
    chain: PrefixChain | None = None  # the prompt's prefix-cache keys (None: not cached)
    route_keys: tuple[str, ...] = ()  # the proxy's prefix keys, reported while this row's K/V is cached

    @property
    def prefilled(self) -> bool:
        return self.length >= self.prompt.num_tokens


class BatchRunner:
    """Sequences live in slots 0..n-1 (packed); callers choose tokens and decide when a sequence ends."""

    def __init__(self, lm: LanguageHalf, max_slots: int, max_len: int, chunk: int = 64, prefix_bytes: int = 0,
                 prefix_block: int = 16):
        self.lm, self.chunk = lm, chunk
        dtype = next(lm.module.parameters()).dtype
        self.cache = SlotCache(lm.config.get_text_config(), max_slots, max_len, dtype, lm.device)
        self.prefix = PrefixCache(self.cache, prefix_bytes, prefix_block) if prefix_bytes > 0 else None
        self.rows: list[Row] = []  # index == slot
        self.num_prefilled_tokens = 0  # prompt tokens run through prefill forwards (a fork prefills none)

    @property
    def num_free_slots(self) -> int:
        """Slots neither held by a row nor reserved for a prefilling row's forks."""
        return self.cache.max_slots - len(self.rows) - sum(len(r.forks) for r in self.rows)

    @property
    def is_full(self) -> bool:
        return self.num_free_slots <= 0

    @property
    def num_prefill_tokens_left(self) -> int:
        """Prompt tokens admitted but not prefilled yet."""
        return sum(r.prompt.num_tokens - r.length for r in self.rows if not r.prefilled)

    def run(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """One step's forwards: decode the rows fed a token, then prefill; a row's failure is reported, not raised."""
        decode_failed: Failed = {}
        prefill_failed: Failed = {}
        logits = self.decode(scheduled.decode, decode_failed)
        logits.update(self.prefill(scheduled.prefill_budget, prefill_failed))
        failed = {k: ("decode", exc) for k, exc in decode_failed.items()}
        failed.update((k, ("prefill", exc)) for k, exc in prefill_failed.items())
        return RunnerOutput(logits, failed)

    @torch.inference_mode()
    def add(self, key: Hashable, prompt: Prompt, forks: Iterable[Hashable] = (), chain: PrefixChain | None = None,
            route_keys: Iterable[str] = ()) -> int:
        """A row for `prompt`; with `forks`, that many more slots are reserved for copies of its prefilled K/V.
        Returns the prompt tokens taken from the prefix cache (with `chain`), which are not prefilled."""
        forks = list(forks)
        assert self.num_free_slots >= 1 + len(forks), "no free slot"
        assert prompt.num_tokens < self.cache.max_len, "prompt does not fit the cache"
        positions, delta = self.lm.position_ids(prompt.input_ids, prompt.images)
        embeds = self.lm.embed(prompt.input_ids, prompt.images)
        state = self.lm.prefill_state(prompt.input_ids, prompt.images)
        slot = len(self.rows)
        self.cache.clear(slot)  # what an earlier occupant left there (possibly non-finite) is gone
        chain = chain if self.prefix is not None and chain is not None else None
        row = Row(key, prompt, embeds, positions, delta, state, forks=forks, chain=chain, route_keys=tuple(route_keys))
        row.length = self._reuse(slot, row)
        self.rows.append(row)
        return row.length

    def _reuse(self, slot: int, row: Row) -> int:
        """Copy the longest cached prefix into the slot; the position its prefill starts from."""
        if self.prefix is None or row.chain is None:
            return 0
        b = self.prefix.block_size
        held = min(self.prefix.match(row.chain.keys), (row.prompt.num_tokens - 1) // b)  # the last token is computed
        start = self.lm.adapter.chunk_end(row.state, 0, held * b)  # e.g. Gemma 3: not inside an image
        self.prefix.load(slot, row.chain.keys[: -(-start // b)])
        self.prefix.record(start)
        return start

    def donate(self, key: Hashable, generated: list[int]) -> None:
        """A finishing row gives the cache its blocks of the prompt followed by the tokens it fed back."""
        slot = next((i for i, r in enumerate(self.rows) if r.key == key), None)
        if self.prefix is None or slot is None or (row := self.rows[slot]).chain is None or not row.prefilled:
            return
        fed = row.length - row.prompt.num_tokens
        self._store(slot, row, row.chain.extend(generated[:fed]))

    def _store(self, slot: int, row: Row, keys: tuple[bytes, ...]) -> None:
        """The cache is an optimisation: failing to fill it is logged, and never fails the request."""
        assert self.prefix is not None
        try:
            held = self.prefix.store(slot, keys)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for a copy: the row carries on uncached
            logger.warning("prefix cache: could not keep %d block(s) (%s: %s)", len(keys), type(exc).__name__, exc)
            return
        if held and row.route_keys:
            self.prefix.note_routes(row.route_keys, keys[held - 1])

    @torch.inference_mode()
    def prefill(self, budget: int, failed: Failed | None = None) -> dict[Hashable, torch.Tensor]:
        """Prefill up to `budget` prompt tokens, chunk by chunk; returns last logits of prompts now complete.

        With `failed`, a row whose chunk raises is recorded there (and left as it is) instead of raising.
        """
        done: dict[Hashable, torch.Tensor] = {}
        slot = 0
        while slot < len(self.rows):
            row = self.rows[slot]
            try:
                while not row.prefilled and budget > 0:
                    n, logits = self._prefill_chunk(slot, row, budget)
                    budget -= n
                    if row.prefilled:
                        done.update(dict.fromkeys([row.key, *row.forks], logits))
                        if row.chain is not None:
                            self._store(slot, row, row.chain.keys)
                        self._fork(slot, row)
                        self._release_prompt(row)
            except Exception as exc:
                if failed is None:
                    raise
                failed[row.key] = exc
            slot += 1  # a fork's rows are prefilled: the loop passes them by
        return done

    def _release_prompt(self, row: Row) -> None:
        """A prefilled row (and its forks) no longer needs the prompt's embeddings or the family's prefill state
        (Qwen3-VL's DeepStack rows): K x N x hidden per image, held on the device for as long as the row runs."""
        full, empty = row.embeds, row.embeds[:, :0]
        for r in self.rows:
            if r.embeds is full:
                r.embeds, r.state = empty, None

    def _fork(self, slot: int, row: Row) -> None:
        """Copy a just-prefilled row into its reserved slots, right after it (rows stay [prefilled..., prefilling...])."""
        n = len(row.forks)
        for j in range(len(self.rows) - 1, slot, -1):  # rows still prefilling make room, last first
            self.cache.move(j, j + n, self.rows[j].length)
        for i in range(1, n + 1):
            self.cache.copy(slot, slot + i, row.length)
        self.rows[slot + 1 : slot + 1] = [Row(key, row.prompt, row.embeds, row.positions, row.rope_delta, None,
                                              row.length, chain=row.chain, route_keys=row.route_keys)
                                          for key in row.forks]
        row.forks = []

    def _prefill_chunk(self, slot: int, row: Row, budget: int) -> tuple[int, torch.Tensor]:
        """Prefill the row's next chunk; returns (tokens prefilled, logits of the chunk's last position)."""
        n = min(self.chunk, budget, row.prompt.num_tokens - row.length)
        start = row.length
        end = self.lm.adapter.chunk_end(row.state, start, start + n)  # e.g. never inside a Gemma 3 image
        n = end - start
        mask = self.cache.set_plan(Plan(slice(slot, slot + 1), [start], n))
        mask = self.lm.adapter.attention_mask(self.lm.config, mask, [start], [row.state])
        extra = self.lm.adapter.prefill_kwargs(row.state, start, end)
        logits = self.lm.forward_rows(row.embeds[:, start:end], row.positions[..., start:end], self.cache, mask,
                                      **extra)
        row.length = end
        self.num_prefilled_tokens += n
        return n, logits[0]

    @torch.inference_mode()
    def decode(self, tokens: dict[Hashable, int], failed: Failed | None = None) -> dict[Hashable, torch.Tensor]:
        """Feed one token to every prefilled row (all of them must be given one); returns next logits.

        With `failed`, a failed batched forward is retried row by row; rows that fail alone are recorded
        there (their length unchanged) and the others' logits are returned.
        """
        rows = [r for r in self.rows if r.prefilled]
        assert rows == self.rows[: len(rows)] and set(tokens) == {r.key for r in rows}, "decode every prefilled row"
        if not rows:
            return {}
        try:
            logits = self._decode_rows(0, rows, tokens)
        except Exception as exc:
            if failed is None:
                raise
            logger.warning("batched decode of %d rows failed (%s: %s); decoding each row alone", len(rows),
                           type(exc).__name__, exc)
            return self._decode_each(rows, tokens, failed)
        for r in rows:
            r.length += 1
        return {r.key: logits[i] for i, r in enumerate(rows)}

    def _decode_rows(self, first_slot: int, rows: list[Row], tokens: dict[Hashable, int]) -> torch.Tensor:
        """One forward of `rows`, which sit in slots first_slot, first_slot + 1, ...; their lengths are not advanced."""
        ids = torch.tensor([[tokens[r.key]] for r in rows])  # host tensors; embed / to_device move them
        positions = torch.cat([self.lm.adapter.decode_position_ids(r.length, r.rope_delta) for r in rows], dim=-2)
        positions = self.lm.to_device(positions)
        starts = [r.length for r in rows]
        mask = self.cache.set_plan(Plan(slice(first_slot, first_slot + len(rows)), starts, 1))
        mask = self.lm.adapter.attention_mask(self.lm.config, mask, starts, [r.state for r in rows])
        return self.lm.forward_rows(self.lm.embed(ids, []), positions, self.cache, mask)

    def _decode_each(self, rows: list[Row], tokens: dict[Hashable, int], failed: Failed) -> dict[Hashable, torch.Tensor]:
        out: dict[Hashable, torch.Tensor] = {}
        for slot, r in enumerate(rows):
            try:
                out[r.key] = self._decode_rows(slot, [r], tokens)[0]
            except Exception as exc:
                failed[r.key] = exc
                continue
            r.length += 1
        return out

    def remove(self, key: Hashable) -> None:
        """Free a sequence's slot (or its reserved one), keeping rows packed as [prefilled..., still prefilling...]."""
        hole = next((i for i, r in enumerate(self.rows) if r.key == key), None)
        if hole is None:  # a fork not made yet: its reservation goes (already gone if its prompt's row was removed)
            for r in self.rows:
                if key in r.forks:
                    r.forks.remove(key)
            return
        num_prefilled = sum(r.prefilled for r in self.rows)
        if hole < num_prefilled:  # the last prefilled row fills it, leaving the hole at the group's end
            self._move(num_prefilled - 1, hole)
            hole = num_prefilled - 1
        self._move(len(self.rows) - 1, hole)
        self.rows.pop()

    def _move(self, src: int, dst: int) -> None:
        if src != dst:
            self.cache.move(src, dst, self.rows[src].length)
            self.rows[dst] = self.rows[src]
