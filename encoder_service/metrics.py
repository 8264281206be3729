"""Prometheus metrics of one encoder worker."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epd_common.metrics import PRODUCER_KEYS, cache_gauges


class EncoderMetrics:
    def __init__(self, registry: CollectorRegistry, cache_stats: Callable[[], dict[str, Any]]):
        self.requests = Counter("epd_encoder_requests", "Encode calls by HTTP status", ["status"], registry=registry)
        self.items_encoded = Counter("epd_encoder_items_encoded", "Items run through the vision tower",
                                     registry=registry)
        self.items_already_cached = Counter("epd_encoder_items_already_cached",
                                            "Items asked for that were already held (not encoded again)",
                                            registry=registry)
        self.encode_seconds = Histogram("epd_encoder_encode_seconds", "Wall time of one encode call",
                                        registry=registry)
        self.run_seconds = Counter("epd_encoder_run_seconds", "Time the encode thread spent running encode calls "
                                   "(waiting for the thread excluded): busy time, for frames or items per second",
                                   registry=registry)
        self.queue_depth = Gauge("epd_encoder_queue_depth", "Encode calls waiting or running", registry=registry)
        cache_gauges(registry, "epd_ec_cache", "Embedding cache (producer side)", cache_stats)
        cache_gauges(registry, "epd_ec_producer", "Connector producer", cache_stats, PRODUCER_KEYS)
