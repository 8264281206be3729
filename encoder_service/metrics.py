"""Prometheus metrics of one encoder worker."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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
        self.queue_depth = Gauge("epd_encoder_queue_depth", "Encode calls waiting or running", registry=registry)
        for key in ("num_items", "bytes", "hits", "misses", "evictions"):
            gauge = Gauge(f"epd_ec_cache_{key}", f"Embedding cache {key} (producer side)", registry=registry)
            gauge.set_function(partial(_stat, cache_stats, key))


def _stat(stats: Callable[[], dict[str, Any]], key: str) -> float:
    return float(stats().get(key, 0))
