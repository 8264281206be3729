"""Prometheus metrics of the proxy."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("epd_proxy_requests", "Chat completions by HTTP status", ["status"],
                                registry=registry)
        self.ttft = Histogram("epd_proxy_ttft_seconds", "Arrival to first content token", buckets=_LATENCY,
                              registry=registry)
        self.itl = Histogram("epd_proxy_inter_token_seconds", "Between streamed chunks", buckets=_LATENCY,
                             registry=registry)
        self.e2e = Histogram("epd_proxy_e2e_seconds", "Arrival to the end of the answer", buckets=_LATENCY,
                             registry=registry)
        self.encode_seconds = Histogram("epd_proxy_encode_seconds", "Fan-out to encoders, per request",
                                        buckets=_LATENCY, registry=registry)
        self.items_skipped = Counter("epd_proxy_items_skipped_cached", "Images not encoded: already cached",
                                     registry=registry)
        self.items_scheduled = Counter("epd_proxy_items_scheduled", "Images sent to an encoder", registry=registry)
        self.retries = Counter("epd_proxy_retries", "Generations retried after re-encoding missing embeddings",
                               registry=registry)
