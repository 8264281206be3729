"""A finished job's engine times as spans of its /generate span (epd_common/tracing.py): the engine thread only
notes times (Job.arrival, Job.admitted, Job.token_times, and while tracing is on Job.prefill_chunks); the spans are
made here, on the request's own thread, once its stream ends, and cost nothing while tracing is off."""
from __future__ import annotations

from collections.abc import Mapping

from decoder_service.engine.sequence import Job
from epd_common import tracing


def trace_job(job: Job) -> None:
    """`queue` (submitted to admitted), `prefill` (admitted to the first token; `resume` for a request continued from
    a prefill worker's hand-off) with a `prefill_chunk` event per chunk its prompt was prefilled in, a `first_token`
    event, and `decode` as one span (first to last token, never a span per token) with a `preempted` and a `resumed`
    event each time one of its choices gave its K/V blocks back and came back, and with speculative decoding the
    tokens proposed and accepted (`epd.spec.*`)."""
    if not tracing.enabled():
        return
    admitted, times, work = job.admitted or job.arrival, job.token_times, job.work
    tracing.record("queue", job.arrival, admitted)
    if not times:
        return
    first, resumed = times[0], work.resume is not None
    chunks = [("prefill_chunk", at, {"epd.tokens": n}) for at, n in job.prefill_chunks if at <= first]
    tracing.record("resume" if resumed else "prefill", admitted, first,
                   {"epd.prompt_tokens": job.prompt.num_tokens, "epd.reused_tokens": job.reused_tokens,
                    "epd.kv_received": resumed and work.resume is not None and work.resume.kv is not None,
                    "epd.chunks": len(chunks)}, chunks)
    tracing.add_event("first_token", first)
    if len(times) > 1:
        tracing.record("decode", first, times[-1], {"epd.tokens": len(times), "epd.choices": job.params.n,
                                                    **spec_attributes(job)}, job.decode_events)


def spec_attributes(job: Job) -> dict[str, int]:
    """Speculative decoding's share of the `decode` span: tokens proposed for the job's choices and how many were
    accepted (absent when nothing was proposed: speculation off, or no proposal for its rows)."""
    if not job.spec_draft_tokens:
        return {}
    return {"epd.spec.draft_tokens": job.spec_draft_tokens, "epd.spec.accepted_tokens": job.spec_accepted_tokens}


def gather_transport(received: Mapping[str, int], inline: bool) -> dict[str, str | int]:
    """The `gather` span's transport: how its embeddings came (connector/tensors/consumer.py `received`)."""
    if inline:
        return {"epd.transport": "inline", "epd.bytes.fetched": 0}  # aggregated: encoded here
    ways = [way for way in ("shm", "socket") if received.get(way, 0) > 0]
    return {"epd.transport": "+".join(ways) or "cache", "epd.bytes.fetched": sum(received.values())}
