"""The decoder's scheduling policy: which requests hold a slot, and how many prompt tokens a step prefills.

nano-vllm's `Scheduler` shape: `schedule()` decides this step (cancelled requests leave, waiting ones are
admitted within the prefill budget) and returns what the `BatchRunner` runs: the token each decoding
sequence feeds back and the prefill budget. The engine postprocesses the logits and tells the scheduler
which sequences `finish` and which `fail`; the scheduler frees their slots. Engine thread only.

A job with n choices is admitted only when n slots are free: its n sequences run under n keys, the first
prefilling the prompt and the others waiting for its K/V (`BatchRunner` forks it). The job is one unit: a
choice that fails ends every choice with one error event, and a cancelled job frees all its slots.
"""
from __future__ import annotations

import collections
import itertools
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epd_common.logs import request_id_var

if TYPE_CHECKING:
    from decoder_service.engine.model_runner import BatchRunner
    from decoder_service.engine.sequence import Job, Sequence

IDLE_PREFILL_FACTOR = 8  # with no stream decoding there is no latency to protect


@dataclass(frozen=True)
class SchedulerOutput:
    decode: dict[Hashable, int]  # slot key -> the token its sequence feeds back (every prefilled row)
    prefill_budget: int  # prompt tokens this step may prefill, chunk by chunk


class Scheduler:
    """Owns the waiting queue and the running sequences (by slot key); the runner owns their slots."""

    def __init__(self, runner: BatchRunner, max_prefill_tokens: int, new_sequence: Callable[[Job, int], Sequence]):
        self.runner, self.max_prefill_tokens, self.new_sequence = runner, max_prefill_tokens, new_sequence
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: dict[int, Sequence] = {}
        self.keys: dict[Job, list[int]] = {}  # job -> the slot keys of its running choices
        self.finished: Counter[str] = Counter()  # finish_reason -> sequences
        self.peak_running = 0  # most sequences decoded together so far
        self._keys = itertools.count()

    @property
    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def prefill_budget(self) -> int:
        """Prompt tokens per step: small while streams decode (their inter-token latency), larger when none do."""
        decoding = any(seq.pending is not None for seq in self.running.values())
        return self.max_prefill_tokens * (1 if decoding else IDLE_PREFILL_FACTOR)

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def schedule(self) -> SchedulerOutput:
        """Drop cancelled requests, admit waiting ones, and say what this step runs."""
        self._abort_cancelled()
        budget = self.prefill_budget
        self._admit(budget)
        feed: dict[Hashable, int] = {key: seq.pending for key, seq in self.running.items() if seq.pending is not None}
        return SchedulerOutput(decode=feed, prefill_budget=budget)

    def finish(self, key: int, reason: str) -> None:
        """Free the slot (a choice that ended well gives its K/V to the prefix cache first), then send the choice's
        last text and `done` (its job's one error event if that fails)."""
        if reason in ("stop", "length"):
            self.runner.donate(key, self.running[key].generated)
        seq = self._drop(key, reason)
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
        for key in list(self.running):
            self.finish(key, "abort")

    def drain(self) -> list[Job]:
        """Every job running or waiting, forgotten (the engine died: it tells them)."""
        jobs = list(self.keys) + list(self.waiting)
        self.running.clear()
        self.keys.clear()
        self.waiting.clear()
        return jobs

    def _abort_cancelled(self) -> None:
        """Clients that went away free their slot now, before the next forward."""
        for key in [k for k, seq in self.running.items() if seq.job.cancelled.is_set()]:
            self.finish(key, "abort")
        num_waiting = len(self.waiting)
        self.waiting = collections.deque(j for j in self.waiting if not j.cancelled.is_set())
        self.finished["abort"] += num_waiting - len(self.waiting)

    def _admit(self, budget: int) -> None:
        """Take waiting requests into free slots (n each), but only as many as this step's prefill budget can start."""
        while (self.waiting and self.runner.num_free_slots >= self.waiting[0].params.n
               and self.runner.num_prefill_tokens_left < budget):
            job = self.waiting.popleft()
            keys = [next(self._keys) for _ in range(job.params.n)]
            request_id_var.set(job.request_id)
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

    def _fail_job(self, job: Job, exc: Exception, stage: str) -> None:
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
