"""Metrics from hand-made request outputs: the numbers vLLM's client would report for them."""
from __future__ import annotations

import numpy as np
import pytest

from epd_bench.backends import RequestOutput
from epd_bench.metrics import calculate_metrics, format_report, is_good, parse_goodput, percentile_key, tpot
from epd_bench.serve import arrival_offsets


def out(ttft: float, latency: float, tokens: int, itl: list[float] | None = None, prompt: int = 10) -> RequestOutput:
    return RequestOutput(success=True, ttft=ttft, latency=latency, output_tokens=tokens, prompt_tokens=prompt,
                         itl=itl or [])


def test_latency_statistics_throughput_and_failures() -> None:
    outputs = [out(0.1, 1.1, 11, [0.1] * 10), out(0.3, 0.3, 1), out(0.2, 2.2, 5, [0.5] * 4),
               RequestOutput(success=False, error="HTTP 500")]
    m = calculate_metrics(outputs, duration=2.0, percentiles=[50, 90, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_output_tokens == 17 and m.total_input_tokens == 30
    assert m.request_throughput == 1.5 and m.output_throughput == 8.5 and m.total_token_throughput == 23.5
    assert m.request_goodput is None
    assert m.latency["ttft"]["mean"] == pytest.approx(200.0) and m.latency["ttft"]["median"] == pytest.approx(200.0)
    assert m.latency["ttft"]["p90"] == pytest.approx(np.percentile([100, 300, 200], 90))
    assert m.latency["tpot"]["mean"] == pytest.approx(300.0)  # (100 + 500) / 2; the 1-token answer has none
    assert m.latency["itl"]["median"] == pytest.approx(100.0)  # 14 gaps pooled: 10 of 0.1 s, 4 of 0.5 s
    assert m.latency["e2el"]["mean"] == pytest.approx(1200.0)
    flat = m.to_json()
    assert flat["p99_ttft_ms"] == m.latency["ttft"]["p99"] and flat["std_itl_ms"] == m.latency["itl"]["std"]


def test_tpot_excludes_the_first_token() -> None:
    assert tpot(out(0.5, 1.5, 11)) == pytest.approx(0.1)
    assert tpot(out(0.5, 0.5, 1)) == 0.0


def test_goodput_needs_every_slo() -> None:
    a, b = out(0.1, 1.1, 11), out(0.5, 0.7, 3)  # tpot 100 ms and 100 ms
    assert is_good(a, {"ttft": 200}) and not is_good(b, {"ttft": 200})
    assert not is_good(a, {"ttft": 200, "e2el": 1000}) and is_good(b, {"tpot": 100, "e2el": 700})
    m = calculate_metrics([a, b], duration=4.0, percentiles=[99], slos_ms={"ttft": 200})
    assert m.request_goodput == 0.25


def test_parse_goodput_and_percentile_names() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 2000.0}
    assert parse_goodput(None) is None
    for bad in (["ttft"], ["itl:3"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert (percentile_key(99), percentile_key(99.9), percentile_key(50.0)) == ("p99", "p99.9", "p50")


def test_report_lists_every_selected_metric() -> None:
    m = calculate_metrics([out(0.1, 0.2, 2, [0.1])], 1.0, [50, 99], {"ttft": 1000}, ("ttft", "e2el"))
    text = format_report(m)
    assert "Request goodput (req/s):" in text and "P99 TTFT (ms):" in text and "Mean E2EL (ms):" in text
    assert "ITL" not in text


def test_arrivals_are_seeded_with_the_requested_mean_rate() -> None:
    times = arrival_offsets(20_000, rate=4.0, burstiness=1.0, seed=1)
    assert times == arrival_offsets(20_000, 4.0, 1.0, 1) and times != arrival_offsets(20_000, 4.0, 1.0, 2)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential gaps: Poisson
    regular = np.diff(arrival_offsets(20_000, 4.0, 4.0, 1))
    assert regular.mean() == pytest.approx(0.25, rel=0.03)
    assert regular.std() / regular.mean() == pytest.approx(0.5, abs=0.05)  # gamma(k=4): CV = 1/sqrt(4)
    assert arrival_offsets(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0] and arrival_offsets(0, 1.0, 1.0, 0) == []
