"""Prometheus metrics of one decoder worker."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epd_common.metrics import CONSUMER_KEYS, LATENCY_BUCKETS, cache_gauges


class DecoderMetrics:
    def __init__(self, registry: CollectorRegistry, cache_stats: Callable[[], dict[str, Any]]):
        self.requests = Counter("epd_decoder_requests", "Generate calls by outcome", ["status"], registry=registry)
        self.ttft = Histogram("epd_decoder_ttft_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.itl = Histogram("epd_decoder_inter_token_seconds", "Between consecutive tokens", buckets=LATENCY_BUCKETS,
                             registry=registry)
        self.e2e = Histogram("epd_decoder_e2e_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS, registry=registry)
        self.gather = Histogram("epd_decoder_gather_seconds", "Fetching embeddings by mm_hash", buckets=LATENCY_BUCKETS,
                                registry=registry)
        self.generated_tokens = Counter("epd_decoder_generated_tokens", "Tokens produced", registry=registry)
        self.prompt_tokens = Counter("epd_decoder_prompt_tokens", "Prompt tokens prefilled", registry=registry)
        self.waiting = Gauge("epd_decoder_waiting", "Requests queued or running", registry=registry)
        cache_gauges(registry, "epd_ec_consumer_cache", "Gathered-embedding cache", cache_stats)
        cache_gauges(registry, "epd_ec_consumer", "Connector consumer", cache_stats, CONSUMER_KEYS)
