"""epd_bench.structured on tiny sizes: the report has both rates, their ratio and the mask cost."""
from __future__ import annotations

import pytest

from epd_bench.structured import run
from epd_builders.tiny import TinySpec


def test_structured_bench_reports_both_rates_and_their_ratio() -> None:
    report = run(TinySpec(), streams=4, max_tokens=8, rounds=1, large_vocab=0, repeats=1)
    free, constrained = report["free_tokens_per_s"], report["constrained_tokens_per_s"]
    assert free > 0 and constrained > 0
    assert report["ratio"] == pytest.approx(constrained / free, abs=2e-3)  # of the unrounded rates
    assert report["mask_us_per_token"] > 0 and "at_large_vocab" not in report
