"""Rows on the paged K/V pool: block tables, prefill chunks and decode rows packed into one forward per step.

`run(scheduled)` is one step: every prefilled row fed a token (decode) and prompt chunks within the step's budget
(prefill) go through ONE forward of the language model (decoder_service/engine/kv_cache.py packs them), so the
step costs one pass over the weights. A family whose prefill needs extra inputs for a chunk (Qwen3-VL's DeepStack
rows) runs that chunk in a forward of its own.

Blocks (decoder_service/engine/block_manager.py): a row takes its prompt's blocks at admission (the cached prefix
by reference, the rest allocated), one more each time its decode crosses a block boundary (`grow`, which the
scheduler makes room for by preempting), and gives them back on `remove`. A completed prompt names its full blocks
in the prefix cache; a finishing (or preempted) row names the blocks of the tokens it fed back too.

n > 1 (one prompt, n choices): the prompt is prefilled once; its forks then share every full block of it and get a
copy of the last, partial one (reserved at admission), each a row of its own from then on, all starting from the
same last-position logits.

Preempted rows come back with the tokens they had fed (`add(..., fed=...)`): prefilled again (mostly from the prefix
cache they named on the way out), then they decode on from their pending token; their recomputed logits are dropped.

Fault isolation: a packed forward that raises is retried segment by segment (the same positions written again), and
only the rows that fail alone are reported in `failed`; the other rows keep their tokens.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch

from decoder_service.engine.block_manager import BlockManager
from decoder_service.engine.cuda_graphs import DecodeGraphs, packed_forward
from decoder_service.engine.fairness import split_prefill_budget
from decoder_service.engine.kv_blocks import import_blocks
from decoder_service.engine.kv_cache import PagedCache
from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.outputs import RowLogits, RunnerOutput, SchedulerOutput
from decoder_service.engine.paged_attention import ATTENTION
from decoder_service.engine.prefix_hash import PrefixChain
from decoder_service.engine.step_inputs import Row, Segment, StepInputs
from decoder_service.engine.work import Prompt
from epd_models.halves import LanguageHalf

logger = logging.getLogger("epd.decoder")
Failed = dict[Hashable, Exception]  # row key -> what broke it


class ModelRunner:
    """Rows by key in admission order; callers choose tokens and decide when a sequence ends."""

    def __init__(self, lm: LanguageHalf, max_slots: int, max_len: int, chunk: int = 64, prefix_bytes: int = 0,
                 prefix_block: int = 16, num_blocks: int | None = None):
        self.lm, self.chunk, self.max_slots, self.max_len = lm, chunk, max_slots, max_len
        self.block_size = b = prefix_block
        dtype = next(lm.module.parameters()).dtype
        self.shape = KVShape.of(lm.config.get_text_config(), dtype)
        if num_blocks is None:  # as many as max_slots sequences of max_len need
            num_blocks = max_slots * -(-max_len // b) + 1
        self.cache = PagedCache(self.shape, num_blocks, b, lm.device)
        block_bytes = self.shape.bytes_per_block(b)
        self.blocks = BlockManager(num_blocks, b, block_bytes, caching=prefix_bytes > 0,
                                   cache_cap=prefix_bytes // block_bytes if prefix_bytes > 0 else None)
        self.prefix = self.blocks if prefix_bytes > 0 else None
        self.rows: dict[Hashable, Row] = {}
        self.num_prefilled_tokens = 0  # positions run through prefill (a fork prefills none)
        self._fresh: list[int] = []  # blocks allocated since the last forward: zeroed before it
        self._forked: dict[Hashable, list[Hashable]] = {}  # this step: prompt row -> the forks made from it
        self._tokens: dict[Hashable, int] = {}  # this step's fed tokens
        lm.module.language_model.config._attn_implementation = ATTENTION
        self.inputs = StepInputs(lm, b)
        self.graphs: DecodeGraphs | None = None  # CUDA: decode-only steps replay captured graphs (enable_graphs)
        self.before_forward: Callable[[], None] | None = None  # called once the step's inputs are ready

    def enable_graphs(self, enforce_eager: bool = False) -> None:
        """CUDA: capture the decode forward for each batch-size bucket (cuda_graphs.py); a no-op elsewhere."""
        graphs = DecodeGraphs(self.lm, self.cache, self.max_slots, self.max_len,
                              packed_forward(self.lm, self.cache, self.inputs.dummy_mask), enforce_eager)
        graphs.capture()
        self.graphs = graphs if graphs.graphs else None

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

    # -- one step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """One step's forward: the rows fed a token, then prefill chunks within the budget; failures reported."""
        failed: Failed = {}
        segments = self._decode_segments(scheduled.decode) + self._prefill_segments(scheduled.prefill_budget)
        logits = self._run_segments(segments, failed)
        resumed: set[Hashable] = set()
        for s in segments:  # a resumed row's recomputed last logits are not a new token's
            if not s.decode and s.row.resumed and s.row.prefilled and s.row.key in logits:
                s.row.resumed = False
                resumed.add(s.row.key)
                del logits[s.row.key]
        for k, forks in self._forked.items():  # forks start from their prompt's last logits
            if k in logits:
                for fork in forks:
                    logits.alias(fork, k)
        self._forked = {}
        stage = {s.row.key: "decode" if s.decode else "prefill" for s in segments if s.row.key in failed}
        return RunnerOutput(logits, {k: (stage.get(k, "prefill"), e) for k, e in failed.items()}, resumed)

    @torch.inference_mode()
    def prefill(self, budget: int, failed: Failed | None = None) -> dict[Hashable, torch.Tensor]:
        """Prefill up to `budget` positions, a forward per round of chunks (no decode); last logits of the prompts
        now complete (and their forks)."""
        done: dict[Hashable, torch.Tensor] = {}
        while budget > 0 and (left := self.num_prefill_tokens_left) > 0:
            done.update(self._step({}, budget, failed))
            budget -= left - self.num_prefill_tokens_left
            if self.num_prefill_tokens_left == left:  # nothing moved (every chunk failed)
                break
        return done

    @torch.inference_mode()
    def decode(self, tokens: dict[Hashable, int], failed: Failed | None = None) -> dict[Hashable, torch.Tensor]:
        """Feed one token to each of these prefilled rows; returns their next logits."""
        return self._step(tokens, 0, failed)

    def _step(self, tokens: dict[Hashable, int], budget: int, failed: Failed | None) -> dict[Hashable, torch.Tensor]:
        sink: Failed = {}
        self.grow(tokens)
        out = self.run(SchedulerOutput(decode=tokens, prefill_budget=budget))
        if out.failed and failed is None:
            raise next(iter(out.failed.values()))[1]
        for k, (_, exc) in out.failed.items():
            (failed if failed is not None else sink)[k] = exc
        return dict(out.logits)

    def _decode_segments(self, tokens: dict[Hashable, int]) -> list[Segment]:
        rows = sorted((self.rows[k] for k in tokens), key=lambda r: r.length)  # by length: StepInputs.decode_runs
        assert all(r.prefilled for r in rows), "only a prefilled row is fed a token"
        self._tokens = tokens
        return [Segment(r, r.length, 1, True) for r in rows]

    def _prefill_segments(self, budget: int) -> list[Segment]:
        """This step's prompt chunks, the budget split between the prompts still prefilling (fairness.py)."""
        rows = [r for r in self.rows.values() if not r.prefilled]
        grant = split_prefill_budget({r.key: self._chunk_limit(r) for r in rows}, budget, self.block_size)
        if not grant:
            return []
        out: list[Segment] = []
        for row in rows:
            start = row.length
            end = start + grant[row.key]
            if row.state is not None and start < row.prompt.num_tokens:
                end = self.lm.adapter.chunk_end(row.state, start, end)  # e.g. never inside a Gemma 3 image
            if end > start:
                out.append(Segment(row, start, end - start, False))
        return out

    def _chunk_limit(self, row: Row) -> int:
        """Positions the row may prefill in one step: its chunk, up to its prompt's end first when the family's state
        covers the prompt only."""
        end = min(row.length + self.chunk, row.target)
        if row.state is not None and row.length < row.prompt.num_tokens:
            end = min(end, row.prompt.num_tokens)
        return end - row.length

    def _run_segments(self, segments: list[Segment], failed: Failed) -> RowLogits:
        logits = RowLogits()
        if not segments:
            return logits
        alone = [s for s in segments if not s.decode and self._extras(s)]
        packed = [s for s in segments if not (not s.decode and self._extras(s))]
        for group in ([packed] if packed else []) + [[s] for s in alone]:
            try:
                self._forward(group, logits)
            except Exception as exc:
                if len(group) == 1:
                    failed[group[0].row.key] = exc
                    continue
                logger.warning("a packed forward of %d rows failed (%s: %s); running each row alone", len(group),
                               type(exc).__name__, exc)
                for s in group:
                    try:
                        self._forward([s], logits)
                    except Exception as exc1:
                        failed[s.row.key] = exc1
        return logits

    def _extras(self, s: Segment) -> dict[str, Any]:
        if s.row.state is None or s.start >= s.row.prompt.num_tokens:
            return {}
        return self.lm.adapter.prefill_kwargs(s.row.state, s.start, s.start + s.num)

    def _forward(self, segments: list[Segment], out: RowLogits) -> None:
        """One forward of these segments (decode rows first); advances their rows; puts the logits at each segment's
        end that completes a row (decode rows, prompts done) into `out`."""
        self.cache.zero(self._fresh)
        self._fresh = []
        plan, embeds, positions = self.inputs.plan(segments, self._tokens)
        extra = self._extras(segments[0]) if len(segments) == 1 and not segments[0].decode else {}
        decode = [s for s in segments if s.decode]
        prefill = [s for s in segments if not s.decode]
        ends = list(range(len(decode))) + [g.first + g.num_q - 1 for g in plan.groups if not g.decode]
        graphs = self.graphs is not None and not prefill
        mask = None if graphs else self.inputs.dummy_mask(embeds)
        if self.before_forward is not None:
            self.before_forward()
        logits = self.graphs.run(plan, embeds, positions) if self.graphs is not None and graphs else None
        if logits is None:
            self.cache.activate(plan)
            try:
                logits = self.lm.forward_rows(embeds, positions, self.cache, mask if mask is not None
                                              else self.inputs.dummy_mask(embeds), ends, **extra)
            finally:
                self.cache.activate(None)
        for s in decode:
            s.row.length += 1
        out.put_rows([s.row.key for s in decode], logits[: len(decode)])
        for j, s in enumerate(prefill, start=len(decode)):
            s.row.length += s.num
            self.num_prefilled_tokens += s.num
            if s.row.prefilled:
                out[s.row.key] = logits[j]
                self._prompt_done(s.row)

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


BatchRunner = ModelRunner  # the name the tests and benchmarks grew up with
