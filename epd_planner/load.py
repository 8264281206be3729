"""How busy each role was over a window, from its workers' spans (pure).

- Encoders: busy seconds (`epd_encoder_run_seconds_total`, the encode thread's run time) ÷ the span's seconds, per
  encoder; queueing is the mean of `epd_encoder_queue_wait_seconds` in the window.
- Decoders and prefill workers: the larger of the K/V blocks in use (1 - free ÷ total) and the sequences held
  (`epd_decoder_waiting`, queued or running, ÷ --max-num-seqs from /health), each the mean of the window's two
  reads; over 1 when more wait than fit. Queueing is the mean of `epd_decoder_request_queue_time_seconds`
  (arrival to admission). The decoders export no step-busy time, so this is the busy signal they have.
"""
from __future__ import annotations

from dataclasses import dataclass

from epd_planner.sample import BadValue
from epd_planner.window import Span, mean, merged, quantile

MAX_BUSY_SHARE = 1.5  # an encoder busy longer than 1.5x the wall time is garbage (one encode thread: at most 1x)


@dataclass(frozen=True)
class Load:
    """One role over one window."""

    busy: float  # replicas' worth of work: the sum over its workers of each one's busy share
    utilization: float | None  # mean busy share of a worker (None: no worker read)
    queue_wait: float | None  # mean seconds a unit of work queued (None: none queued in the window)
    rate: float  # units of work per second in the window
    unit: str  # what `rate` counts
    kv_used: float | None = None  # decoders: the largest K/V share in use of any of them
    itl_p90: float | None = None  # decoders: inter-token latency p90 on the workers


def encoder_load(spans: list[Span]) -> Load:
    busy, items, waits = 0.0, 0.0, []
    for s in spans:
        share = s.delta("epd_encoder_run_seconds_total") / s.seconds
        if share > MAX_BUSY_SHARE:
            raise BadValue(f"{s.end.url}: busy {share:.2f}x its wall time")
        busy += min(share, 1.0)
        items += s.delta("epd_encoder_items_encoded_total") / s.seconds
        waits.append(s.histogram("epd_encoder_queue_wait_seconds"))
    return Load(busy, busy / len(spans) if spans else None, mean(merged(waits)), items, "items/s")


def decoder_load(spans: list[Span]) -> Load:
    busy, tokens, kv_max, waits, itls = 0.0, 0.0, None, [], []
    for s in spans:
        kv = _kv_used(s)
        held = s.gauge("epd_decoder_waiting")
        slots = s.end.values.get("max_num_seqs")
        share = max(kv or 0.0, held / slots if held is not None and slots else 0.0)
        busy += share
        kv_max = kv if kv_max is None or (kv is not None and kv > kv_max) else kv_max
        tokens += s.delta("epd_decoder_generated_tokens_total") / s.seconds
        waits.append(s.histogram("epd_decoder_request_queue_time_seconds"))
        itls.append(s.histogram("epd_decoder_inter_token_latency_seconds"))
    return Load(busy, busy / len(spans) if spans else None, mean(merged(waits)), tokens, "tokens/s", kv_max,
                quantile(merged(itls), 0.9))


def _kv_used(s: Span) -> float | None:
    """The mean share of K/V blocks in use over the two reads (None before the engine runs: no blocks)."""
    shares = []
    for read in (s.start, s.end):
        total, free = read.values.get("epd_decoder_kv_blocks_total", 0.0), read.values.get("epd_decoder_kv_blocks_free")
        if total > 0 and free is not None:
            if free > total:
                raise BadValue(f"{read.url}: more K/V blocks free ({free:g}) than in the pool ({total:g})")
            shares.append(1 - free / total)
    return sum(shares) / len(shares) if shares else None


def load_of(role: str, spans: list[Span]) -> Load:
    return encoder_load(spans) if role == "encoder" else decoder_load(spans)
