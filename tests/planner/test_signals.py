"""What the planner reads: the metric names it needs are the ones the proxy, encoders and decoders export (built
from their own metric classes), a sample survives JSON, and a quantile is Prometheus' histogram_quantile."""
from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from epd_planner.sample import Histogram, Sample, Scrape
from epd_planner.signals import KEPT, parse_instances, parse_metrics, proxy_addresses
from epd_planner.window import quantile

LABELLED = {"epd_proxy_requests_total", "epd_decoder_requests_total"}  # no series before their first event


def exported(role: str) -> str:
    registry = CollectorRegistry()
    if role == "proxy":
        from proxy.metrics import ProxyMetrics

        ProxyMetrics(registry)
    elif role == "encoder":
        from encoder_service.metrics import EncoderMetrics

        EncoderMetrics(registry, dict)
    else:
        from decoder_service.metrics import DecoderMetrics

        DecoderMetrics(registry, dict)
    return generate_latest(registry).decode()


@pytest.mark.parametrize("role", ["proxy", "encoder", "decoder", "prefill"])
def test_the_metrics_the_planner_reads_are_the_ones_each_service_exports(role: str) -> None:
    values, histograms = parse_metrics(exported(role), KEPT[role])  # no required metric missing
    kept = KEPT[role]
    assert set(kept["values"]) - LABELLED <= set(values)
    assert set(kept["histograms"]) | set(kept["quantiles"]) == set(histograms)
    assert all(histograms[name].buckets for name in kept["quantiles"])
    assert all(not histograms[name].buckets for name in kept["histograms"])


def test_a_quantile_interpolates_within_its_bucket_as_prometheus_does() -> None:
    h = Histogram(0.0, 10.0, [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (math.inf, 10.0)])
    # p50: rank 5, in (0.1, 0.5] holding 4 (cumulative 2 -> 6): 0.1 + 0.4 x (5 - 2) / 4 = 0.4
    assert quantile(h, 0.5) == pytest.approx(0.4)
    # p90: rank 9, in (0.5, 1]: 0.5 + 0.5 x (9 - 6) / 4 = 0.875
    assert quantile(h, 0.9) == pytest.approx(0.875)
    # everything past the last finite bound: that bound; no observations: None
    assert quantile(Histogram(0.0, 3.0, [(0.1, 0.0), (math.inf, 3.0)]), 0.9) == 0.1
    assert quantile(Histogram(0.0, 0.0, [(0.1, 0.0), (math.inf, 0.0)]), 0.9) is None


def test_a_sample_survives_json() -> None:
    h = Histogram(1.5, 3.0, [(0.1, 1.0), (math.inf, 3.0)])
    sample = Sample(12.5, 1700000000.0, [Scrape("http://p", "proxy", 12.6, histograms={"x": h})],
                    [Scrape("http://e", "encoder", 12.7, values={"a_total": 2.0}),
                     Scrape("http://d", "decoder", 12.8, healthy=False),
                     Scrape("http://d2", "decoder", 12.9, error="cannot read http://d2: HTTP 500")])
    line = sample.to_json()
    assert "\n" not in line and "Infinity" not in line and '"+Inf"' in line
    assert Sample.from_json(line) == sample


def test_instances_are_read_by_role() -> None:
    body = {"encoders": [{"url": "http://e:1/", "healthy": True, "load": 0}],
            "decoders": [{"url": "http://d:2", "healthy": False, "load": 3, "reason": "down"}]}
    assert parse_instances(body) == [("http://e:1", "encoder", True), ("http://d:2", "decoder", False)]


def test_proxy_addresses_lists_each_address_of_the_host() -> None:
    assert proxy_addresses("http://127.0.0.1:8000") == ["http://127.0.0.1:8000"]
    assert proxy_addresses("http://no-such-host.invalid:8000") == []
