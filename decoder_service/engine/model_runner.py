"""One step of the engine's rows: prefill chunks and decode rows packed into one forward of the language model.

`run(scheduled)` is one step: every prefilled row fed a token (decode) and prompt chunks within the step's budget
(prefill) go through ONE forward of the language model (decoder_service/engine/step_inputs.py packs them), so the
step costs one pass over the weights. A family whose prefill needs extra inputs for a chunk (Qwen3-VL's DeepStack
rows) runs that chunk in a forward of its own. The rows' blocks, forks and prefix-cache names are
decoder_service/engine/rows.py's; `prefill` and `decode` are the same step for callers that drive rows directly
(decoder_service/generate.py, the tests).

Fault isolation: a packed forward that raises is retried segment by segment (the same positions written again), and
only the rows that fail alone are reported in `failed`; the other rows keep their tokens.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

from decoder_service.engine.cuda_graphs import DecodeGraphs, packed_forward
from decoder_service.engine.fairness import split_prefill_budget
from decoder_service.engine.outputs import RowLogits, RunnerOutput, SchedulerOutput
from decoder_service.engine.paged_attention import ATTENTION
from decoder_service.engine.rows import RowTable
from decoder_service.engine.step_inputs import Row, Segment, StepInputs
from epd_models.halves import LanguageHalf

logger = logging.getLogger("epd.decoder")
Failed = dict[Hashable, Exception]  # row key -> what broke it


class ModelRunner(RowTable):
    """Runs the rows' steps (rows.py keeps their blocks); callers choose tokens and decide when a sequence ends."""

    def __init__(self, lm: LanguageHalf, max_slots: int, max_len: int, chunk: int = 64, prefix_bytes: int = 0,
                 prefix_block: int = 16, num_blocks: int | None = None):
        super().__init__(lm, max_slots, max_len, prefix_bytes, prefix_block, num_blocks)
        self.chunk = chunk
        self.num_prefilled_tokens = 0  # positions run through prefill (a fork prefills none)
        self._tokens: dict[Hashable, int] = {}  # this step's fed tokens
        lm.module.language_model.config._attn_implementation = ATTENTION
        self.inputs = StepInputs(lm, self.block_size)
        self.graphs: DecodeGraphs | None = None  # CUDA: decode-only steps replay captured graphs (enable_graphs)
        self.before_forward: Callable[[], None] | None = None  # called once the step's inputs are ready
        # called after each forward with its layout: (row key, first position, positions) per segment, packed order
        self.after_forward: Callable[[list[tuple[Hashable, int, int]]], None] | None = None

    def use_decode_kernel(self, kernel: Any) -> None:
        """CPU: decode rows (and verification rows, a row per query) read through the in-place kernel
        (decoder_service/engine/cpu_attention.py) where the family's mask is the plain causal one; None: gather."""
        self.cache.decode_kernel = kernel
        self.inputs.in_place = kernel is not None and self.inputs.plain_causal

    def enable_graphs(self, enforce_eager: bool = False) -> None:
        """CUDA: capture the decode forward for each batch-size bucket (cuda_graphs.py); a no-op elsewhere, and at
        tensor-parallel size > 1 (every step eager: the graphs are not captured per rank yet) and with LoRA adapters
        (which rows take which adapter changes every step)."""
        if self.lm.ranks is not None or self.lm.lora is not None:
            return
        graphs = DecodeGraphs(self.lm, self.cache, self.max_slots, self.max_len,
                              packed_forward(self.lm, self.cache, self.inputs.dummy_mask), enforce_eager)
        graphs.capture()
        self.graphs = graphs if graphs.graphs else None

    # -- one step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """One step's forward: the rows fed a token, then prefill chunks within the budget; failures reported."""
        failed: Failed = {}
        segments = self._decode_segments(scheduled.decode, scheduled.drafts) \
            + self._prefill_segments(scheduled.prefill_budget)
        logits = self._run_segments(segments, failed)
        verify = {s.row.key: (logits.pop_own(s.row.key), list(s.feed[1:])) for s in segments
                  if s.feed and s.row.key in logits}
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
        stage = {s.row.key: "decode" if s.decode or s.feed else "prefill" for s in segments if s.row.key in failed}
        return RunnerOutput(logits, {k: (stage.get(k, "prefill"), e) for k, e in failed.items()}, resumed, verify)

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

    def _decode_segments(self, tokens: dict[Hashable, int], drafts: dict[Hashable, list[int]] | None = None
                         ) -> list[Segment]:
        """A segment per row fed a token: one position, or (speculative decoding) the fed token and its drafts, a
        verification: a query of k + 1 positions over the row's blocks, in the same forward (its logits at each)."""
        drafts = drafts or {}
        rows = sorted((self.rows[k] for k in tokens), key=lambda r: r.length)  # by length: StepInputs.decode_runs
        assert all(r.prefilled for r in rows), "only a prefilled row is fed a token"
        self._tokens = tokens
        return [Segment(r, r.length, 1, True) if not (d := drafts.get(r.key))
                else Segment(r, r.length, 1 + len(d), False, (tokens[r.key], *d)) for r in rows]

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
        ends, first = list(range(len(decode))), len(decode)
        for s in prefill:  # a chunk's last position; every position of a verification
            ends += range(first, first + s.num) if s.feed else [first + s.num - 1]
            first += s.num
        if self.lm.lora is not None:  # each packed position's adapter (decode rows first, as packed)
            self.lm.lora.bind((s.row.prompt.lora, s.num) for s in decode + prefill)
        graphs = self.graphs is not None and not prefill
        mask = None if graphs else self.inputs.dummy_mask(embeds)
        if self.before_forward is not None:
            self.before_forward()
        logits = self.graphs.run(plan, embeds, positions) if self.graphs is not None and graphs else None
        if logits is None:
            if self.lm.ranks is not None:  # tensor parallelism: the other ranks run this step with this one
                self.lm.ranks.forward(plan, embeds, positions, extra)
            self.cache.activate(plan)
            try:
                logits = self.lm.forward_rows(embeds, positions, self.cache, mask if mask is not None
                                              else self.inputs.dummy_mask(embeds), ends, **extra)
            except Exception as exc:
                if self.lm.ranks is not None:  # the ranks are mid-forward: they cannot be brought back in step
                    self.lm.ranks.fail(f"a forward failed on rank 0: {type(exc).__name__}: {exc}")
                raise
            finally:
                self.cache.activate(None)
        if self.after_forward is not None:  # e.g. EAGLE-3 files the step's captured hidden states by row
            self.after_forward([(s.row.key, s.start, s.num) for s in decode + prefill])
        for s in decode:
            s.row.length += 1
        out.put_rows([s.row.key for s in decode], logits[: len(decode)])
        j = len(decode)
        for s in prefill:
            s.row.length += s.num
            if s.feed:  # the caller rolls the length back to what it accepts (spec/verify.py)
                out[s.row.key] = logits[j : j + s.num]
                j += s.num
                continue
            self.num_prefilled_tokens += s.num
            if s.row.prefilled:
                out[s.row.key] = logits[j]
                self._prompt_done(s.row)
            j += 1
