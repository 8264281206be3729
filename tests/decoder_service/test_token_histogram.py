"""The decoder's per-token histograms (TTFT, inter-token latency) export exactly what prometheus_client's Histogram
would for the same observations (less its `_created` sample), bucket bounds inclusive."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from decoder_service.metrics import TokenHistogram
from epd_common.metrics import LATENCY_BUCKETS


def test_the_exposition_is_prometheus_clients() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("epd_test_seconds", "doc", buckets=LATENCY_BUCKETS, registry=theirs)
    fast = TokenHistogram("epd_test_seconds", "doc", ours)
    values = [0.0, 1e-9, 0.005, 0.0051, 0.7, 1, 2.5, 60, 60.0001, 1e9, *[i / 97 for i in range(300)]]
    for v in values:
        reference.observe(v)
        fast.observe(v)
    expected = [line for line in generate_latest(theirs).decode().splitlines() if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == expected
    assert f"epd_test_seconds_count {float(len(values))}" in expected
