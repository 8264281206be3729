"""Prometheus metrics of the proxy."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from epd_common.metrics import LATENCY_BUCKETS, multiprocess_registry
from proxy.workers import ROLES
from scheduler.affinity import ROUTES


class FleetView(Protocol):
    """What the gauges read of the fleet at scrape time (proxy/fleet.py's Fleet)."""

    def healthy_count(self, role: str) -> int: ...

    def items_outstanding(self) -> int: ...


class ProxyMetrics:
    """The proxy's metrics. With a `multiprocess_dir` (--proxy-workers N), the caller has switched this process to
    prometheus_client's multiprocess mode (epd_common.metrics.use_multiprocess) before making them."""

    def __init__(self, registry: CollectorRegistry, multiprocess_dir: str | None = None):
        self.registry, self.multiprocess_dir = registry, multiprocess_dir
        self.requests = Counter("epd_proxy_requests", "Chat and text completions by endpoint and HTTP status (refusals "
                                "and 500s included)", ["endpoint", "status"], registry=registry)
        self.in_flight = Gauge("epd_proxy_requests_in_flight", "Chat and text completions being answered",
                               registry=registry, multiprocess_mode="livesum")  # --proxy-workers N: all processes
        self.prompt_tokens = Counter("epd_proxy_prompt_tokens", "Prompt tokens of answered requests (image tokens "
                                     "included; vLLM's prompt_tokens)", registry=registry)
        self.generation_tokens = Counter("epd_proxy_generation_tokens", "Tokens generated for answered requests, every "
                                         "choice's (vLLM's generation_tokens)", registry=registry)
        self.ttft = Histogram("epd_proxy_time_to_first_token_seconds", "Arrival to first content token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("epd_proxy_inter_token_latency_seconds", "Between streamed chunks",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("epd_proxy_e2e_request_latency_seconds", "Arrival to the end of the answer",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.encode_seconds = Histogram("epd_proxy_encode_seconds", "Fan-out to encoders, per request",
                                        buckets=LATENCY_BUCKETS, registry=registry)
        self.items_skipped = Counter("epd_proxy_items_skipped_cached", "Images not encoded: already cached",
                                     registry=registry)
        self.items_joined = Counter("epd_proxy_items_joined_in_flight",
                                    "Images not encoded again: another request's encode of them was in flight",
                                    registry=registry)
        self.items_scheduled = Counter("epd_proxy_items_scheduled", "Images sent to an encoder", registry=registry)
        self.handoffs = Counter("epd_proxy_handoffs", "Generations handed from a prefill worker to a decode worker "
                                "(E -> P -> D)", registry=registry)
        self.handoffs_declined = Counter("epd_proxy_handoffs_declined", "Generations a prefill worker declined to "
                                         "hand off (a short prompt: --handoff-min-tokens), run on a decode worker",
                                         registry=registry)
        self.retries = Counter("epd_proxy_retries", "Generations retried after re-encoding missing embeddings",
                               registry=registry)
        self.encoder_busy = Counter("epd_proxy_encoder_busy", "Encode calls an encoder refused as busy (503 "
                                    "encoder_busy): moved to another encoder, or tried again", registry=registry)
        self.failovers = Counter("epd_proxy_failovers", "Work moved to another worker after one failed", ["role"],
                                 registry=registry)
        self.workers_marked_down = Counter("epd_proxy_workers_marked_down", "Workers taken out of service", ["role"],
                                           registry=registry)
        for role in ("encoder", "decoder"):  # exported as 0 from the start, so dashboards and alerts see them
            self.failovers.labels(role)
            self.workers_marked_down.labels(role)
        self.affinity_routed = Counter("epd_proxy_affinity_routed",
                                       "Decoder choices by prefix affinity: hit (to the decoder holding the longest "
                                       "prefix), overloaded (it was too busy), miss (no decoder held any)",
                                       ["result"], registry=registry)
        for result in ROUTES:
            self.affinity_routed.labels(result)
        self.fleet_gauges = FleetGauges()
        registry.register(self.fleet_gauges)

    def answered(self, usage: dict[str, Any]) -> None:
        """A finished answer's tokens (its usage, as the client gets it)."""
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["completion_tokens"])

    def watch(self, fleet: FleetView) -> None:
        """Gauges read from the fleet at scrape time."""
        self.fleet_gauges.fleet = fleet

    @property
    def scrape(self) -> CollectorRegistry:
        """What /metrics answers: this registry, or with --proxy-workers N the sum over every proxy process's files
        and this process's fleet gauges (each process probes the same workers)."""
        if self.multiprocess_dir is None:
            return self.registry
        return multiprocess_registry(self.multiprocess_dir, self.fleet_gauges)


class FleetGauges:
    """The fleet's gauges, read at scrape time: healthy workers per role (prefill workers too: 0 when there are
    none) and the encoder items outstanding. Not kept in files in multiprocess mode: the answering process's view."""

    def __init__(self) -> None:
        self.fleet: FleetView | None = None

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily("epd_proxy_workers_healthy", "Workers taking work", labels=["role"])
        for role in ROLES:
            healthy.add_metric([role], self.fleet.healthy_count(role) if self.fleet else 0)
        yield healthy
        yield GaugeMetricFamily("epd_proxy_encoder_items_outstanding", "Images sent to encoders and not finished (the "
                                "proxy's encoder queue depth)",
                                value=self.fleet.items_outstanding() if self.fleet else 0)
