"""Prometheus metrics of one decoder worker."""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from epd_common.metrics import CONSUMER_KEYS, LATENCY_BUCKETS, cache_gauges

BYTE_BUCKETS = tuple(float(1 << k) for k in range(10, 33, 2))  # 1 KiB to 4 GiB, powers of 4


class DecoderMetrics:
    def __init__(self, registry: CollectorRegistry, cache_stats: Callable[[], dict[str, Any]]):
        self.requests = Counter("epd_decoder_requests", "Generate calls by outcome", ["status"], registry=registry)
        self.handoffs = Counter("epd_decoder_handoff_resumes", "Requests continued from a prefill worker's hand-off, by "
                                "how their prompt's K/V came: kv (received) or recomputed (prefilled here: the blocks "
                                "could not be had)", ["how"], registry=registry)
        self.ttft = TokenHistogram("epd_decoder_time_to_first_token_seconds", "Arrival to first token", registry)
        self.itl = TokenHistogram("epd_decoder_inter_token_latency_seconds", "Between consecutive tokens", registry)
        self.e2e = Histogram("epd_decoder_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=registry)
        # a finished choice's phases, as vLLM splits a request's: queued, prefill, decode (request_finished)
        self.queue_time = Histogram("epd_decoder_request_queue_time_seconds", "Arrival to admission by the engine's "
                                    "scheduler", buckets=LATENCY_BUCKETS, registry=registry)
        self.prefill_time = Histogram("epd_decoder_request_prefill_time_seconds", "Admission to first token",
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.decode_time = Histogram("epd_decoder_request_decode_time_seconds", "First token to last token",
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.gather = Histogram("epd_decoder_gather_seconds", "Fetching embeddings by mm_hash", buckets=LATENCY_BUCKETS,
                                registry=registry)
        self.gathered_bytes = Histogram("epd_decoder_gathered_bytes", "Embedding bytes one request gathered (requests "
                                        "with images, from the connector)", buckets=BYTE_BUCKETS, registry=registry)
        self.generated_tokens = Counter("epd_decoder_generated_tokens", "Tokens produced", registry=registry)
        self.prompt_tokens = Counter("epd_decoder_prompt_tokens", "Prompt tokens prefilled", registry=registry)
        self.waiting = Gauge("epd_decoder_waiting", "Requests queued or running", registry=registry)
        cache_gauges(registry, "epd_ec_consumer_cache", "Gathered-embedding cache", cache_stats)
        cache_gauges(registry, "epd_ec_consumer", "Connector consumer", cache_stats, CONSUMER_KEYS)
        self.prefix_stats: Callable[[], dict[str, int]] = dict  # the engine's prefix cache, once it runs one
        self.kv_stats: Callable[[], dict[str, int]] = dict  # the engine's K/V pool, once it runs
        self.kv_store_stats: Callable[[], dict[str, Any]] = dict  # a prefill worker's hand-off store (else empty)
        self.spec_stats: Callable[[], dict[str, Any] | None] = _off  # the engine's SpecStats.summary() (None: off)
        registry.register(_PrefixCollector(self))

    def request_finished(self, arrival: float, admitted: float, first: float, last: float) -> None:
        """One finished choice's queue, prefill and decode times (perf_counter() stamps; 0: never reached)."""
        if admitted:
            self.queue_time.observe(admitted - arrival)
            if first:
                self.prefill_time.observe(first - admitted)
                self.decode_time.observe(last - first)


def _off() -> None:
    return None


class TokenHistogram:
    """A histogram observed once per generated token on the engine thread: plain numbers and a bisect (0.3 us an
    observation, where prometheus_client's Histogram takes 1.2 us with its locks), exported at scrape time under
    the same names (`_bucket`, `_count`, `_sum`). One writer; a scrape reads a consistent enough snapshot."""

    def __init__(self, name: str, doc: str, registry: CollectorRegistry, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.doc, self.bounds = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: +Inf
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a bucket's bound is inclusive (le), as Prometheus has it
        self.sum += value

    def collect(self) -> Iterator[Metric]:
        counts, total, cumulative = list(self.counts), self.sum, 0
        buckets = []
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


_PREFIX_COUNTERS = (("hits", "Admitted prompts that reused cached K/V"),
                    ("misses", "Admitted prompts that found none to reuse"),
                    ("evicted_blocks", "K/V blocks evicted to make room"),
                    ("tokens_saved", "Prompt tokens not prefilled: their K/V was reused"))


_KV_GAUGES = (("blocks_total", "K/V blocks in the pool (the null block not counted)"),
              ("blocks_free", "K/V blocks an allocation can take (free, or cached and unreferenced)"),
              ("blocks_cached", "K/V blocks the prefix cache names"),
              ("block_size", "Positions per K/V block"),
              ("bytes_per_token", "K/V bytes of one position, every layer"))


# vLLM's names (vllm:spec_decode_*); summary key -> name suffix, help
_SPEC_COUNTERS = (("drafts", "num_drafts", "Verifications run: one per sequence per step that proposed tokens for it"),
                  ("draft_tokens", "num_draft_tokens", "Tokens proposed (--speculative-config)"),
                  ("accepted_tokens", "num_accepted_tokens", "Proposed tokens the verification kept"))


_KV_STORE_GAUGES = (("items", "Hand-offs a prefill worker holds for pickup"),
                    ("bytes", "Bytes of K/V blocks it holds for pickup"),
                    ("max_bytes", "The hand-off store's bound (--kv-store-bytes)"))


class _PrefixCollector:
    """The prefix cache's counters and the K/V pool's gauges, read at scrape time (the engine thread only adds to
    plain ints)."""

    def __init__(self, metrics: DecoderMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self.metrics.prefix_stats()
        for key, doc in _PREFIX_COUNTERS:
            yield CounterMetricFamily(f"epd_decoder_prefix_cache_{key}", doc, value=stats.get(key, 0))
        yield GaugeMetricFamily("epd_decoder_prefix_cache_bytes", "Bytes of K/V blocks held",
                                value=stats.get("bytes", 0))
        kv = self.metrics.kv_stats()
        for key, doc in _KV_GAUGES:
            yield GaugeMetricFamily(f"epd_decoder_kv_{key}", doc, value=kv.get(key, 0))
        yield CounterMetricFamily("epd_decoder_preemptions", "Sequences preempted (their K/V recomputed later)",
                                  value=kv.get("preemptions", 0))
        yield from _spec_counters(self.metrics.spec_stats())
        if store := self.metrics.kv_store_stats():  # a prefill worker only
            for key, doc in _KV_STORE_GAUGES:
                yield GaugeMetricFamily(f"epd_decoder_kv_store_{key}", doc, value=store.get(key, 0))
            left = CounterMetricFamily("epd_decoder_kv_store_freed", "Hand-offs freed, by why: released (their "
                                       "decode worker had them), expired (--kv-ttl), evicted (--kv-store-bytes)",
                                       labels=["why"])
            for why in ("released", "expired", "evicted"):
                left.add_metric([why], store.get(why, 0))
            yield left
            yield CounterMetricFamily("epd_decoder_kv_store_puts", "Hand-offs kept", value=store.get("puts", 0))


def _spec_counters(spec: dict[str, Any] | None) -> Iterator[Metric]:
    """Speculative decoding's counters: 0 while it is off (so dashboards and alerts always find them), the
    per-position one with a sample per draft position 0..k-1 only while it is on."""
    spec = spec or {}
    for key, name, doc in _SPEC_COUNTERS:
        yield CounterMetricFamily(f"epd_decoder_spec_decode_{name}", doc, value=spec.get(key, 0))
    per_pos = CounterMetricFamily("epd_decoder_spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, "
                                  "by their position in the draft (0: the first proposed)", labels=["position"])
    for position, count in enumerate(spec.get("accepted_per_position", ())):
        per_pos.add_metric([str(position)], count)
    yield per_pos
