"""A finished job's `decode` span (decoder_service/job_trace.py) carries speculative decoding's counts, the tokens
proposed and accepted for its choices, when any were proposed; without speculation it has no `epd.spec.*`."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from decoder_service.engine.sequence import Job
from decoder_service.engine.work import Prompt, Work
from decoder_service.job_trace import trace_job
from epd_common import tracing
from epd_contracts.sampling import SamplingParams
from tests.test_tracing_off import exported  # noqa: F401 (the fixture: tracing on in memory)

PARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


def finished_job(loop: asyncio.AbstractEventLoop, drafted: int, accepted: int) -> Job:
    """A job as the engine leaves it: 6 prompt tokens, 5 tokens chosen 10 ms apart, `drafted` proposed."""
    work = Work(Prompt(torch.zeros(1, 6, dtype=torch.int64), []), SamplingParams(max_tokens=5, temperature=0))
    job = Job(work=work, loop=loop, arrival=1.0, admitted=1.001, spec_draft_tokens=drafted,
              spec_accepted_tokens=accepted)
    job.token_times.extend(1.01 + 0.01 * i for i in range(5))
    return job


def decode_span(exported: Any, job: Job) -> Any:  # noqa: F811
    with tracing.span("POST /generate", kind="server", parent=PARENT):
        trace_job(job)
    (decode,) = [s for s in exported() if s.name == "decode"]
    return decode


@pytest.mark.parametrize("drafted,accepted", [(12, 7), (3, 0)])
def test_the_decode_span_says_how_many_tokens_were_proposed_and_accepted(  # type: ignore[no-untyped-def]
        exported, drafted: int, accepted: int) -> None:  # noqa: F811
    loop = asyncio.new_event_loop()
    try:
        attributes = decode_span(exported, finished_job(loop, drafted, accepted)).attributes
    finally:
        loop.close()
    assert attributes["epd.spec.draft_tokens"] == drafted and attributes["epd.spec.accepted_tokens"] == accepted
    assert attributes["epd.tokens"] == 5


def test_without_proposals_the_decode_span_has_no_spec_attributes(exported) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    loop = asyncio.new_event_loop()
    try:
        attributes = decode_span(exported, finished_job(loop, 0, 0)).attributes
    finally:
        loop.close()
    assert attributes["epd.tokens"] == 5 and not [k for k in attributes if k.startswith("epd.spec.")]
