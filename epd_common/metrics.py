"""Metric pieces shared by the services."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, disable_created_metrics

# every counter is exported as `_total` alone: no `_created` twin per series (a timestamp no dashboard reads, doubling
# what a scrape carries). Every service's metrics module imports this one before making a metric.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # seconds
CACHE_KEYS = ("num_items", "bytes", "max_bytes", "hits", "misses", "evictions", "rejected")
PRODUCER_KEYS = ("gets_served", "gets_waited", "gets_waiting", "bytes_sent", "bad_messages", "events_published")
CONSUMER_KEYS = ("gathers", "remote_fetches", "bytes_received")


def cache_gauges(registry: CollectorRegistry, prefix: str, what: str, stats: Callable[[], dict[str, Any]],
                 keys: tuple[str, ...] = CACHE_KEYS) -> None:
    """One gauge per counter of a stats() dict (embedding cache, connector), read at scrape time."""
    for key in keys:
        Gauge(f"{prefix}_{key}", f"{what}: {key}", registry=registry).set_function(partial(_stat, stats, key))


def _stat(stats: Callable[[], dict[str, Any]], key: str) -> float:
    return float(stats().get(key, 0))
