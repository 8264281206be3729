"""The decoder's scheduler: which sequences run, how many prompt tokens a step prefills, who is preempted.

nano-vllm's `Scheduler` shape: `schedule()` decides this step (cancelled requests leave; every decoding row gets
the block its next position needs, a sequence preempted while the pool has none; preempted sequences and waiting
requests are admitted, fairest first, while the pool has their prompt's blocks, rows are free and the prefill
budget lasts) and returns what the `ModelRunner` runs: the token each decoding sequence feeds back and the
prefill budget. The engine postprocesses the logits and tells the scheduler which sequences `finish` and which
`fail`; the scheduler frees their blocks. Engine thread only.

The n choices of a job are independent sequences, admitted as rows free up (vLLM's engine does so): a wave of
choices is one row that prefills the prompt (from the prefix cache where its blocks are held) and forks for the
others (`ModelRunner` forks them); a job continued from a prefill worker's hand-off takes a row per continuing
choice (continuation.py). The job is one unit: a choice that fails ends every choice with one error event, and a
cancelled job frees all its blocks.

Who takes the next free row, how many rows a job may hold (--max-seqs-per-request) and whose sequence is preempted
is the fair-share policy across clients (decoder_service/engine/fairness.py); this module does the mechanics: admit,
preempt, resume, finish.

Preemption is by recompute (vLLM's default): the preempted sequence keeps its sampler, detokenizer and pending
token, gives its blocks back (naming its full ones in the prefix cache first) and waits, first of its client's;
re-admitted, it prefills its prompt and the tokens it had fed, then decodes on. Never an out-of-memory, never a
failed request.
"""
from __future__ import annotations

import collections
import itertools
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING

from decoder_service.engine.continuation import continue_choices
from decoder_service.engine.fairness import choices_left, next_pick, preempt_choice, room_victims, share_of
from decoder_service.engine.outputs import SchedulerOutput
from epd_common.logs import request_id_var

if TYPE_CHECKING:
    from decoder_service.engine.model_runner import ModelRunner
    from decoder_service.engine.sequence import Job, Sequence
    from decoder_service.engine.spec.propose import Speculator

WATERMARK = 0.01  # of the pool's blocks kept free at admission, so new rows can grow before anyone is preempted


class Scheduler:
    """Owns the waiting queue and the running sequences (by slot key); the runner owns their slots."""

    def __init__(self, runner: ModelRunner, max_prefill_tokens: int, new_sequence: Callable[[Job, int], Sequence],
                 max_batched_tokens: int = 0, share: int = 0, speculator: Speculator | None = None):
        self.runner, self.max_prefill_tokens, self.new_sequence = runner, max_prefill_tokens, new_sequence
        self.speculator = speculator  # speculative decoding: each step's drafts (engine/spec/propose.py)
        self.share = share or max(1, runner.max_slots // 2)  # rows one job's choices hold at once
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
        """Prompt tokens this step packs beside its `decoding` rows: what --max-num-batched-tokens leaves them (vLLM's
        chunked prefill: the step's token budget bounds its inter-token latency), capped at --max-prefill-tokens
        while streams decode when that is positive (0, the default: no separate cap)."""
        room = max(1, self.max_batched_tokens - decoding)
        return min(room, self.max_prefill_tokens) if decoding and self.max_prefill_tokens else room

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def schedule(self) -> SchedulerOutput:
        """Drop cancelled requests, make room for every decoding row's next block, admit, say what this step runs."""
        self._abort_cancelled()
        feed = self._decoding()
        while self.runner.blocks_to_grow(feed) > self.runner.num_free_blocks:
            self._preempt()
            feed = self._decoding()
        self.runner.grow(feed)
        drafts = self.speculator.drafts(feed, self.running, self.runner, self.runner.num_free_blocks - self._watermark,
                                        len(self.running) + len(self.waiting) + len(self.preempted)) \
            if self.speculator is not None else {}
        budget = self.prefill_budget(len(feed) + sum(len(d) for d in drafts.values()))
        preempted = self.num_preempted
        self._admit(budget)
        if self.num_preempted != preempted:  # admission preempted some (`_room`): they decode no more this step
            feed = {k: t for k, t in feed.items() if k in self.running}
            drafts = {k: d for k, d in drafts.items() if k in feed}
        if self._continuing():  # the budget its prompt had on a prefill worker (nothing decodes there)
            budget = max(budget, self.prefill_budget(0))
        return SchedulerOutput(decode=feed, prefill_budget=budget, drafts=drafts)

    def _continuing(self) -> bool:
        """A continued request's prompt prefills here (its prefill worker's K/V could not be had, E -> P -> D): its
        stream has its first token and waits for this prefill, which a fresh prompt gets whole on a prefill worker."""
        rows = self.runner.rows
        return any(seq.job.work.resume is not None and (row := rows.get(k)) is not None and not row.prefilled
                   for k, seq in self.running.items())

    def _decoding(self) -> dict[Hashable, int]:
        return {key: seq.pending for key, seq in self.running.items()
                if seq.pending is not None and self.runner.is_decoding(key)}

    def _preempt(self, among: Iterable[int] | None = None) -> None:
        """A decoding sequence (of `among`) of the client holding the most blocks (the one of them holding the most,
        the newest of equals) gives its blocks back and waits first in line."""
        key = preempt_choice(self.running, self.runner.rows,
                             among if among is not None else (k for k in self.running if self.runner.is_decoding(k)))
        seq = self.running.pop(key)
        self.runner.donate(key, seq.generated)
        self.runner.remove(key)
        self.preempted.appendleft((key, seq))
        self.num_preempted += 1
        seq.job.decode_events.append(("preempted", time.perf_counter(), {"epd.choice": seq.index}))  # traced

    def _resume(self, key: int, seq: Sequence) -> bool:
        """A preempted sequence comes back when the pool has its blocks again (False: not yet)."""
        fed = seq.generated[:-1] if seq.pending is not None else seq.generated
        need = self.runner.blocks_to_admit(seq.job.prompt.num_tokens + len(fed), 1, None)
        if not self._room(need, seq.job.work.client):
            return False
        self.preempted.remove((key, seq))
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
            return True
        self.running[key] = seq
        return True

    def _room(self, need: int, client: str) -> bool:
        """Whether `need` blocks (beyond the watermark) are free for a request of `client`, after preempting, while
        they are not, decoding sequences of a client holding at least two rows more than `client` does (so clients'
        rows even out; never a sequence of its own client or of one as light)."""
        while need + self._watermark > self.runner.num_free_blocks and self.running:
            heavier = room_victims(self.running, client, self.runner.is_decoding)
            if not heavier:
                return False
            self._preempt(heavier)
        return True

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
        for job in self.waiting:  # choices not admitted yet (a job's others just ended): its stream ends too
            job.emit_error("the decoder is closing; retry on another decoder")
        self.waiting.clear()

    def _unpreempt(self, only: Callable[[Sequence], bool] = lambda seq: True) -> None:
        """Preempted sequences (those `only` picks) back among the running, so finish/fail find them."""
        for key, seq in [(k, s) for k, s in self.preempted if only(s)]:
            self.running[key] = seq
        self.preempted = collections.deque((k, s) for k, s in self.preempted if not only(s))

    def drain(self) -> list[Job]:
        """Every job running or waiting, forgotten (the engine died: it tells them)."""
        jobs = list(dict.fromkeys([*self.keys, *self.waiting]))
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
        """Admit preempted sequences and waves of waiting jobs' choices, fairest first (`_next`), while rows are free
        and the pool has their prompt's blocks (beyond a watermark)."""
        self.waiting = collections.deque(j for j in self.waiting if not j.errored and choices_left(j))
        while self.runner.num_free_slots >= 1 and (pick := self._next(budget)) is not None:
            if isinstance(pick, tuple):
                if not self._resume(*pick):
                    break
            elif not self._admit_wave(pick):
                break
        self.peak_running = max(self.peak_running, len(self.running))

    def _next(self, budget: int) -> tuple[int, Sequence] | Job | None:
        """The next preempted sequence or waiting job to take a row (fairness.next_pick), `budget` being this
        step's prefill budget."""
        return next_pick(self.running, self.runner.rows, self.preempted, self.waiting, self.keys, self.share,
                         within_budget=self.runner.num_prefill_tokens_left < budget)

    def _admit_wave(self, job: Job) -> bool:
        """The job's next choices, as many as its share and the free rows allow (a hand-off job's all n), when the
        pool has their blocks (False: not yet)."""
        held = len(self.keys.get(job, ()))
        free = self.runner.num_free_slots
        k = min(choices_left(job), free, share_of(job, self.share) - held)
        if job.work.handoff_key is not None and k < job.params.n:
            return False  # its n rows together
        if job.work.resume is None:
            need = self.runner.blocks_to_admit(job.prompt.num_tokens, k, job.work.chain)
        else:  # a row per continuing choice, each with the whole prompt's blocks (no forks)
            need = k * self.runner.blocks_to_admit(job.prompt.num_tokens, 1, job.work.chain)
        if not self._room(need, job.work.client):
            return False
        if not job.admitted:
            job.admitted = time.perf_counter()  # its queue wait ends (traced: decoder_service/job_trace.py)
        request_id_var.set(job.request_id)
        if job.work.resume is not None:
            self._admit_resumed(job, k)
        else:
            self._admit_fresh(job, k)
        if not job.errored and not choices_left(job):
            self.waiting.remove(job)
        return True

    def _admit_fresh(self, job: Job, k: int) -> None:
        """Choices next_choice .. +k: one row prefilling the prompt (its held prefix from the cache), k - 1 forks."""
        first = job.next_choice
        job.next_choice += k
        keys = [next(self._keys) for _ in range(k)]
        try:  # its samplers (seeds), guides, embedding merge and positions: its failure is its own
            seqs = [self.new_sequence(job, i) for i in range(first, first + k)]
            reused = self.runner.add(keys[0], job.prompt, forks=keys[1:], chain=job.work.chain,
                                     route_keys=job.work.route_keys)
        except Exception as exc:
            self._fail_job(job, exc, "admission")
            return
        if first == 0:
            job.reused_tokens = reused
        self.running.update(zip(keys, seqs, strict=True))
        self.keys.setdefault(job, []).extend(keys)

    def _admit_resumed(self, job: Job, k: int) -> None:
        """A job a prefill worker began (E -> P -> D): its next k continuing choices take rows (continuation.py)."""
        try:
            continue_choices(job, k, self.new_sequence, self.runner, lambda: next(self._keys), self._took)
        except Exception as exc:
            self._fail_job(job, exc, "admission")

    def _took(self, job: Job, key: int, seq: Sequence) -> None:
        self.running[key] = seq
        self.keys.setdefault(job, []).append(key)

    def _fail_job(self, job: Job, exc: Exception, stage: str) -> None:
        self._unpreempt(lambda seq: seq.job is job)
        if job not in self.keys:  # no row of it ran yet (its admission failed): counted once
            self.finished["error"] += 1
        for key in [k for k in self.keys.get(job, []) if k in self.running]:
            self._drop(key, "error")
        self.keys.pop(job, None)
        job.fail(exc, stage)  # its choices not admitted yet never are (errored)

    def _drop(self, key: int, reason: str) -> Sequence:
        self.runner.remove(key)
        self.finished[reason] += 1
        seq = self.running.pop(key)
        keys = self.keys[seq.job]
        keys.remove(key)
        if not keys:
            del self.keys[seq.job]
        return seq
