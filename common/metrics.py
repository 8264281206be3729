"""Metric pieces shared by the services."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # seconds
CACHE_KEYS = ("num_items", "bytes", "hits", "misses", "evictions")


def cache_gauges(registry: CollectorRegistry, prefix: str, what: str, stats: Callable[[], dict[str, Any]]) -> None:
    """One gauge per embedding-cache counter, read from stats() at scrape time."""
    for key in CACHE_KEYS:
        Gauge(f"{prefix}_{key}", f"{what}: {key}", registry=registry).set_function(partial(_stat, stats, key))


def _stat(stats: Callable[[], dict[str, Any]], key: str) -> float:
    return float(stats().get(key, 0))
