"""Prometheus metrics of one decoder worker."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class DecoderMetrics:
    def __init__(self, registry: CollectorRegistry, cache_stats: Callable[[], dict[str, Any]]):
        self.requests = Counter("epd_decoder_requests", "Generate calls by outcome", ["status"], registry=registry)
        self.ttft = Histogram("epd_decoder_ttft_seconds", "Arrival to first token", buckets=_LATENCY,
                              registry=registry)
        self.itl = Histogram("epd_decoder_inter_token_seconds", "Between consecutive tokens", buckets=_LATENCY,
                             registry=registry)
        self.e2e = Histogram("epd_decoder_e2e_seconds", "Arrival to last token", buckets=_LATENCY, registry=registry)
        self.gather = Histogram("epd_decoder_gather_seconds", "Fetching embeddings by mm_hash", buckets=_LATENCY,
                                registry=registry)
        self.generated_tokens = Counter("epd_decoder_generated_tokens", "Tokens produced", registry=registry)
        self.prompt_tokens = Counter("epd_decoder_prompt_tokens", "Prompt tokens prefilled", registry=registry)
        self.waiting = Gauge("epd_decoder_waiting", "Requests queued or running", registry=registry)
        for key in ("num_items", "bytes", "hits", "misses", "evictions"):
            gauge = Gauge(f"epd_ec_consumer_cache_{key}", f"Gathered-embedding cache {key}", registry=registry)
            gauge.set_function(partial(_stat, cache_stats, key))


def _stat(stats: Callable[[], dict[str, Any]], key: str) -> float:
    return float(stats().get(key, 0))
