"""The decoder's scheduling policy: which sequences run, how many prompt tokens a step prefills, who is preempted.

nano-vllm's `Scheduler` shape: `schedule()` decides this step (cancelled requests leave, preempted sequences and
then waiting requests are admitted while the pool has their prompt's blocks, rows are free and the prefill budget
lasts; every decoding row gets the block its next position needs, the newest running sequence preempted while the
pool has none) and returns what the `ModelRunner` runs: the token each decoding sequence feeds back and the
prefill budget. The engine postprocesses the logits and tells the scheduler which sequences `finish` and which
`fail`; the scheduler frees their blocks. Engine thread only.

A job with n choices is admitted only when n rows are free: its n sequences run under n keys, the first
prefilling the prompt and the others waiting for its K/V (`ModelRunner` forks it). The job is one unit: a
choice that fails ends every choice with one error event, and a cancelled job frees all its blocks.

Preemption is by recompute (vLLM's default): the preempted sequence keeps its sampler, detokenizer and pending
token, gives its blocks back (naming its full ones in the prefix cache first) and waits at the front of the queue;
re-admitted, it prefills its prompt and the tokens it had fed, then decodes on. Never an out-of-memory, never a
failed request.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from decoder_service.engine.outputs import SchedulerOutput
from epd_common.logs import request_id_var

if TYPE_CHECKING:
    from decoder_service.engine.model_runner import ModelRunner
    from decoder_service.engine.sequence import Job, Sequence

logger = logging.getLogger("epd.decoder")
WATERMARK = 0.01  # of the pool's blocks kept free at admission, so new rows can grow before anyone is preempted


class Scheduler:
    """Owns the waiting queue and the running sequences (by slot key); the runner owns their slots."""

    def __init__(self, runner: ModelRunner, max_prefill_tokens: int, new_sequence: Callable[[Job, int], Sequence],
                 max_batched_tokens: int = 0):
        self.runner, self.max_prefill_tokens, self.new_sequence = runner, max_prefill_tokens, new_sequence
        self.max_batched_tokens = max_batched_tokens or max(2048, runner.max_slots)
        self.waiting: collections.deque[Job] = collections.deque()
        self.preempted: collections.deque[tuple[int, Sequence]] = collections.deque()  # first back in
        self.running: dict[int, Sequence] = {}
        self.num_preempted = 0  # sequences preempted so far
        self.keys: dict[Job, list[int]] = {}  # job -> the slot keys of its running choices
        self.finished: Counter[str] = Counter()  # finish_reason -> sequences
        self.peak_running = 0  # most sequences decoded together so far
        self._keys = itertools.count()

    @property
    def is_idle(self) -> bool:
        return not self.running and not self.waiting and not self.preempted

    def prefill_budget(self, decoding: int) -> int:
        """Prompt tokens this step packs beside its `decoding` rows: --max-prefill-tokens while streams decode (their
        inter-token latency), the whole --max-num-batched-tokens when none do."""
        room = max(1, self.max_batched_tokens - decoding)
        return min(room, self.max_prefill_tokens) if decoding else room

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def schedule(self) -> SchedulerOutput:
        """Drop cancelled requests, make room for every decoding row's next block, admit, say what this step runs."""
        self._abort_cancelled()
        feed = self._decoding()
        while self.runner.blocks_to_grow(feed) > self.runner.num_free_blocks:
            self._preempt_newest()
            feed = self._decoding()
        self.runner.grow(feed)
        budget = self.prefill_budget(len(feed))
        self._resume(budget)
        self._admit(budget)
        return SchedulerOutput(decode=feed, prefill_budget=budget)

    def _decoding(self) -> dict[Hashable, int]:
        return {key: seq.pending for key, seq in self.running.items()
                if seq.pending is not None and self.runner.is_decoding(key)}

    def _preempt_newest(self) -> None:
        """The most recently admitted decoding sequence gives its blocks back and waits first in line."""
        key = max(k for k in self.running if self.runner.is_decoding(k))
        seq = self.running.pop(key)
        self.runner.donate(key, seq.generated)
        self.runner.remove(key)
        self.preempted.appendleft((key, seq))
        self.num_preempted += 1
        seq.job.decode_events.append(("preempted", time.perf_counter(), {"epd.choice": seq.index}))  # traced

    def _resume(self, budget: int) -> None:
        """Preempted sequences come back first, each when the pool has its blocks again."""
        while self.preempted and self.runner.num_free_slots >= 1 and self.runner.num_prefill_tokens_left < budget:
            key, seq = self.preempted[0]
            fed = seq.generated[:-1] if seq.pending is not None else seq.generated
            need = self.runner.blocks_to_admit(seq.job.prompt.num_tokens + len(fed), 1, None)
            if need + self._watermark > self.runner.num_free_blocks and self.running:
                return
            self.preempted.popleft()
            seq.job.decode_events.append(("resumed", time.perf_counter(), {"epd.choice": seq.index}))  # traced
            request_id_var.set(seq.job.request_id)
            try:
                self.runner.add(key, seq.job.prompt, chain=seq.job.work.chain, route_keys=seq.job.work.route_keys,
                                fed=fed)
            except Exception as exc:
                self.keys[seq.job].remove(key)
                if not self.keys[seq.job]:
                    del self.keys[seq.job]
                self.finished["error"] += 1
                seq.job.fail(exc, "resume")
                continue
            self.running[key] = seq

    @property
    def _watermark(self) -> int:
        return int(WATERMARK * self.runner.blocks.num_usable)

    def finish(self, key: int, reason: str) -> None:
        """Free the slot (a choice that ended well gives its K/V to the prefix cache first), then send the choice's
        last text and `done` (its job's one error event if that fails). "handoff": the choice continues on a decode
        worker (E -> P -> D), which sends its text and `done`; here it only gives its blocks back."""
        if reason in ("stop", "length", "handoff"):
            self.runner.donate(key, self.running[key].generated)
        seq = self._drop(key, reason)
        if reason == "handoff":
            return
        try:
            seq.finish(reason)
        except Exception as exc:
            self._fail_job(seq.job, exc, "finish")

    def fail(self, key: int, exc: Exception, stage: str) -> None:
        """One choice failed: its request (every choice) gets one error event, and all its slots back."""
        if key in self.running:  # a sibling's failure may have ended it already this step
            self._fail_job(self.running[key].job, exc, stage)

    def abort_all(self) -> None:
        """Closing: running streams end cleanly instead of hanging."""
        self._unpreempt()
        for key in list(self.running):
            self.finish(key, "abort")

    def _unpreempt(self, only: Callable[[Sequence], bool] = lambda seq: True) -> None:
        """Preempted sequences (those `only` picks) back among the running, so finish/fail find them."""
        for key, seq in [(k, s) for k, s in self.preempted if only(s)]:
            self.running[key] = seq
        self.preempted = collections.deque((k, s) for k, s in self.preempted if not only(s))

    def drain(self) -> list[Job]:
        """Every job running or waiting, forgotten (the engine died: it tells them)."""
        jobs = list(self.keys) + list(self.waiting)
        self.running.clear()
        self.preempted.clear()
        self.keys.clear()
        self.waiting.clear()
        return jobs

    def _abort_cancelled(self) -> None:
        """Clients that went away free their blocks now, before the next forward."""
        self._unpreempt(lambda seq: seq.job.cancelled.is_set())
        for key in [k for k, seq in self.running.items() if seq.job.cancelled.is_set()]:
            self.finish(key, "abort")
        num_waiting = len(self.waiting)
        self.waiting = collections.deque(j for j in self.waiting if not j.cancelled.is_set())
        self.finished["abort"] += num_waiting - len(self.waiting)

    def _admit(self, budget: int) -> None:
        """Take waiting requests (n rows each) while the pool has their prompt's blocks (beyond a watermark), but
        only as many as this step's prefill budget can start; none while a preempted sequence waits."""
        while (self.waiting and not self.preempted and self.runner.num_free_slots >= self.waiting[0].params.n
               and self.runner.num_prefill_tokens_left < budget):
            job = self.waiting[0]
            if job.work.resume is None:
                need = self.runner.blocks_to_admit(job.prompt.num_tokens, job.params.n, job.work.chain)
            else:  # a row per continuing choice, each with the whole prompt's blocks (no forks)
                need = job.work.resume.rows * self.runner.blocks_to_admit(job.prompt.num_tokens, 1, job.work.chain)
            if need + self._watermark > self.runner.num_free_blocks and self.running:
                return
            self.waiting.popleft()
            job.admitted = time.perf_counter()  # its queue wait ends (traced: decoder_service/job_trace.py)
            request_id_var.set(job.request_id)
            if job.work.resume is not None:
                self._admit_resumed(job)
                continue
            keys = [next(self._keys) for _ in range(job.params.n)]
            try:  # its samplers (seeds), guides, embedding merge and positions: its failure is its own
                seqs = [self.new_sequence(job, i) for i in range(job.params.n)]
                job.reused_tokens = self.runner.add(keys[0], job.prompt, forks=keys[1:], chain=job.work.chain,
                                                    route_keys=job.work.route_keys)
            except Exception as exc:
                self.finished["error"] += 1
                job.fail(exc, "admission")
                continue
            self.running.update(zip(keys, seqs, strict=True))
            self.keys[job] = keys
        self.peak_running = max(self.peak_running, len(self.running))

    def _admit_resumed(self, job: Job) -> None:
        """A job a prefill worker began (E -> P -> D): each continuing choice replays its first token and takes a row
        over the received K/V blocks (or, when they could not be had, a row that prefills the prompt here with its
        logits dropped, as a preempted row's); a row per choice, each decoding on from its first token."""
        resume = job.work.resume
        assert resume is not None
        keys: list[int] = []
        try:
            for i, choice in enumerate(resume.handoff.choices):
                if choice.first_token is None:  # it ended at its first token on the prefill worker
                    continue
                seq = self.new_sequence(job, i)
                if (reason := seq.replay(choice.first_token, choice.generator_state, choice.logprobs)) is not None:
                    seq.finish(reason)  # not expected (the prefill worker ran the same rules): end it here
                    continue
                key = next(self._keys)
                self._add_resumed(key, job)
                self.running[key] = seq
                keys.append(key)
        except Exception as exc:
            for key in keys:
                self.runner.remove(key)
                del self.running[key]
            self.finished["error"] += 1
            job.fail(exc, "admission")
            return
        if keys:
            self.keys[job] = keys

    def _add_resumed(self, key: int, job: Job) -> None:
        """A continuing choice's row: over the received blocks (after the held prefix), else prefilled here."""
        resume, work = job.work.resume, job.work
        assert resume is not None
        if resume.kv is not None:
            try:
                self.runner.add_prefilled(key, job.prompt, resume.kv, chain=work.chain, route_keys=work.route_keys,
                                          first_block=resume.first_block)
                return
            except ValueError as exc:  # the held prefix was evicted since the fetch: prefill here after all
                logger.warning("request %s: %s; prefilling here", job.request_id, exc)
        self.runner.add(key, job.prompt, chain=work.chain, route_keys=work.route_keys, fed=())

    def _fail_job(self, job: Job, exc: Exception, stage: str) -> None:
        self._unpreempt(lambda seq: seq.job is job)
        for key in [k for k in self.keys.get(job, []) if k in self.running]:
            self._drop(key, "error")
        job.fail(exc, stage)

    def _drop(self, key: int, reason: str) -> Sequence:
        self.runner.remove(key)
        self.finished[reason] += 1
        seq = self.running.pop(key)
        keys = self.keys[seq.job]
        keys.remove(key)
        if not keys:
            del self.keys[seq.job]
        return seq
