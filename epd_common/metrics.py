"""Metric pieces shared by the services."""
from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, disable_created_metrics, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

# every counter is exported as `_total` alone: no `_created` twin per series (a timestamp no dashboard reads, doubling
# what a scrape carries). Every service's metrics module imports this one before making a metric.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # seconds
CACHE_KEYS = ("num_items", "bytes", "max_bytes", "hits", "misses", "evictions", "rejected")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode: where each process keeps its values
PRODUCER_KEYS = ("gets_served", "gets_waited", "gets_waiting", "bytes_sent", "bad_messages", "events_published")
CONSUMER_KEYS = ("gathers", "remote_fetches", "bytes_received")


def cache_gauges(registry: CollectorRegistry, prefix: str, what: str, stats: Callable[[], dict[str, Any]],
                 keys: tuple[str, ...] = CACHE_KEYS) -> None:
    """One gauge per counter of a stats() dict (embedding cache, connector), read at scrape time."""
    for key in keys:
        Gauge(f"{prefix}_{key}", f"{what}: {key}", registry=registry).set_function(partial(_stat, stats, key))


def _stat(stats: Callable[[], dict[str, Any]], key: str) -> float:
    return float(stats().get(key, 0))


def use_multiprocess(directory: str) -> None:
    """Every metric made from now on in this process keeps its values in `directory`, in files one scrape of any
    process adds up (prometheus_client's multiprocess mode). prometheus_client picks its value class from
    PROMETHEUS_MULTIPROC_DIR when it is first imported; a process that imported it before knowing the directory
    switches here, before it makes its metrics."""
    os.environ[MULTIPROC_ENV] = directory
    values.ValueClass = values.MultiProcessValue()


def multiprocess_registry(directory: str, *live: Collector) -> CollectorRegistry:
    """What a scrape answers in multiprocess mode: the sum over every process's files (counters and histograms
    summed, live gauges of the live processes summed), and this process's scrape-time collectors (`live`)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    for collector in live:
        registry.register(collector)
    return registry
