"""Prometheus metrics of one encoder worker."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connector.tensors.disk_tier import DISK_KEYS
from epd_common.metrics import LATENCY_BUCKETS, PRODUCER_KEYS, cache_gauges

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 65536)
ITEM_BUCKETS = (0.001, 0.0025, *LATENCY_BUCKETS)  # an item of a batch on a GPU takes a few milliseconds


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
        self.pending_tokens = Gauge("epd_encoder_pending_tokens", "Vision tokens of the items waiting for the encode "
                                    "thread (admission refuses calls past --max-pending-encode-tokens)", registry=registry)
        self.batch_items = Histogram("epd_encoder_batch_items", "Items per vision forward", buckets=BATCH_BUCKETS,
                                     registry=registry)
        self.batch_tokens = Histogram("epd_encoder_batch_tokens", "Vision tokens per vision forward",
                                      buckets=TOKEN_BUCKETS, registry=registry)
        self.item_encode = Histogram("epd_encoder_item_encode_seconds", "An item's share of its vision forward: the "
                                     "forward's wall time over the items in it (observed once per item)",
                                     buckets=ITEM_BUCKETS, registry=registry)
        self.queue_wait = Histogram("epd_encoder_queue_wait_seconds", "An item's wait for its vision forward",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        cache_gauges(registry, "epd_ec_cache", "Embedding cache (producer side)", cache_stats)
        cache_gauges(registry, "epd_ec_producer", "Connector producer", cache_stats, PRODUCER_KEYS)
        # disk_*: the disk tier (--ec-disk-dir; 0 when off); ungathered_*: stored, not fetched by a decoder yet
        cache_gauges(registry, "epd_ec", "Embeddings", cache_stats, (*DISK_KEYS, "ungathered_bytes",
                                                                     "ungathered_aged_out"))
