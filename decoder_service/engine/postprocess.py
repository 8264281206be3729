"""A step's postprocess: each row's logits become its token (sampled, read back in one transfer), its sequence's
text and events; rows that finish, fail or are handed off leave the scheduler. Engine thread only."""
from __future__ import annotations

from typing import Any, Protocol, cast

import torch

from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.outputs import RunnerOutput
from decoder_service.engine.readback import read_back, read_back_rows
from decoder_service.engine.sampling import choose_rows
from decoder_service.engine.scheduler import Scheduler
from decoder_service.engine.sequence import Job, Sequence
from decoder_service.engine.spec.stats import SpecStats
from decoder_service.engine.spec.verify import verify_rows
from epd_common.logs import request_id_var


class HandoffSink(Protocol):
    """A prefill worker's hand-off (decoder_service/handoff.py HandoffOut): the prompt's blocks (`pool_blocks`) copied
    out of `cache` now, kept for a decode worker, and the job's `handoff` event sent with each choice's first token."""

    def hand_off(self, job: Job, seqs: list[Sequence], pool_blocks: list[int], cache: Any) -> None: ...


def postprocess(out: RunnerOutput, scheduler: Scheduler, vocab_size: int, spec: SpecStats | None = None) -> list[Job]:
    """End the rows whose forward failed; every other row samples its token, then streams it or finishes. Returns
    the prefill-only jobs (a hand-off's) whose first tokens came this step.

    Plain greedy rows choose in one batched argmax, every other row by its own sampler in its own try
    (sampling.choose_rows); every row's token comes back in one transfer, logprobs in one more."""
    for key, (stage, exc) in out.failed.items():
        assert isinstance(key, int), "engine keys are ints"
        scheduler.fail(key, exc, stage)
    running = scheduler.running
    keys = cast(list[int], list(out.logits))  # the engine's row keys are ints (Scheduler)
    picked, batch = choose_rows([(key, seq.sampler) for key in keys if (seq := running.get(key)) is not None],
                                out.logits)
    chosen: dict[int, torch.Tensor] = {}
    for key, choice in picked.items():
        if isinstance(choice, Exception):
            scheduler.fail(key, choice, "sampling")
        else:
            chosen[key] = choice
    tokens = read_back(chosen, vocab_size, batch)
    packed = {k: p for k in chosen if (seq := running.get(k)) is not None and (p := seq.sampler.packed) is not None}
    logprobs = read_back_rows(packed)  # rows that asked for logprobs: one more transfer for all of them
    first: dict[Job, None] = {}
    for key in keys:  # in the runner's order, as each row chose
        if (token := tokens.get(key)) is not None and (job := accept(scheduler, key, token, logprobs.get(key))):
            first[job] = None
    if out.verify:  # speculative decoding: each verifying row keeps its accepted drafts and one more token
        verify_rows(out.verify, scheduler, scheduler.runner, spec, accept)
    return list(first)


def accept(scheduler: Scheduler, key: int, token: int | Exception, logprobs: list[float] | None = None) -> Job | None:
    """The row's chosen token becomes its text and events; it finishes on a stop, or fails (with its siblings).
    Returns its job if that is to be handed off now (a prefill-only job's first token)."""
    seq = scheduler.running.get(key)
    if seq is None:  # a sibling choice failed this step: the whole job ended
        return None
    request_id_var.set(seq.job.request_id)
    try:
        if isinstance(token, Exception):
            raise token
        seq.pending = None
        reason = seq.on_token(token, logprobs)
    except Exception as exc:
        scheduler.fail(key, exc, "output")
        return None
    if reason is not None:
        scheduler.finish(key, reason)
    return seq.job if seq.job.work.handoff_key is not None and seq.num_generated == 1 else None


def hand_off(jobs: list[Job], scheduler: Scheduler, runner: ModelRunner, sink: HandoffSink) -> None:
    """Prefill-only jobs whose choices all have their first token: their K/V to the hand-off sink (which sends the
    `handoff` event), their rows freed."""
    running = scheduler.running
    for job in jobs:
        keys = [k for k in scheduler.keys.get(job, []) if k in running]
        if not keys:  # every choice ended at its first token: their `done`s end the stream
            continue
        request_id_var.set(job.request_id)
        try:  # the blocks are copied out now; the `handoff` event follows once they are kept
            sink.hand_off(job, [running[k] for k in keys], runner.rows[keys[0]].blocks, runner.cache)
        except Exception as exc:
            scheduler.fail(keys[0], exc, "handoff")
            continue
        for key in keys:
            scheduler.finish(key, "handoff")
