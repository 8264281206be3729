"""A decode worker's side of a hand-off, on the engine thread (E -> P -> D): a job a prefill worker began has each
continuing choice replay the first token streamed there, then take a row over the received K/V blocks, or, when they
could not be had, a row that prefills the prompt here with its logits dropped (as a preempted row's)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decoder_service.engine.model_runner import ModelRunner
    from decoder_service.engine.sequence import Job, Sequence

logger = logging.getLogger("epd.decoder")


def continue_choices(job: Job, k: int, new_sequence: Callable[[Job, int], Sequence], runner: ModelRunner,
                     new_key: Callable[[], int], took: Callable[[Job, int, Sequence], None]) -> None:
    """The job's next k continuing choices, each running (`took`) from its first token on; raises for the job's
    failure (the rows it took so far are the scheduler's to free)."""
    resume = job.work.resume
    assert resume is not None
    taken = 0
    choices = resume.handoff.choices
    while taken < k and job.next_choice < len(choices):
        i, choice = job.next_choice, choices[job.next_choice]
        job.next_choice += 1
        if choice.first_token is None:  # it ended at its first token on the prefill worker
            continue
        seq = new_sequence(job, i)
        if (reason := seq.replay(choice.first_token, choice.generator_state, choice.logprobs)) is not None:
            seq.finish(reason)  # not expected (the prefill worker ran the same rules): end it here
            continue
        key = new_key()
        _add_row(runner, key, job)
        took(job, key, seq)
        taken += 1


def _add_row(runner: ModelRunner, key: int, job: Job) -> None:
    """A continuing choice's row: over the received blocks (after the held prefix), else prefilled here."""
    resume, work = job.work.resume, job.work
    assert resume is not None
    if resume.kv is not None:
        try:
            runner.add_prefilled(key, job.prompt, resume.kv, chain=work.chain, route_keys=work.route_keys,
                                 first_block=resume.first_block)
            return
        except ValueError as exc:  # the held prefix was evicted since the fetch: prefill here after all
            logger.warning("request %s: %s; prefilling here", job.request_id, exc)
    runner.add(key, job.prompt, chain=work.chain, route_keys=work.route_keys, fed=())
