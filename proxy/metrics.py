"""Prometheus metrics of the proxy."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from common.metrics import LATENCY_BUCKETS


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("epd_proxy_requests", "Chat completions by HTTP status", ["status"],
                                registry=registry)
        self.ttft = Histogram("epd_proxy_ttft_seconds", "Arrival to first content token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.itl = Histogram("epd_proxy_inter_token_seconds", "Between streamed chunks", buckets=LATENCY_BUCKETS,
                             registry=registry)
        self.e2e = Histogram("epd_proxy_e2e_seconds", "Arrival to the end of the answer", buckets=LATENCY_BUCKETS,
                             registry=registry)
        self.encode_seconds = Histogram("epd_proxy_encode_seconds", "Fan-out to encoders, per request",
                                        buckets=LATENCY_BUCKETS, registry=registry)
        self.items_skipped = Counter("epd_proxy_items_skipped_cached", "Images not encoded: already cached",
                                     registry=registry)
        self.items_scheduled = Counter("epd_proxy_items_scheduled", "Images sent to an encoder", registry=registry)
        self.retries = Counter("epd_proxy_retries", "Generations retried after re-encoding missing embeddings",
                               registry=registry)
