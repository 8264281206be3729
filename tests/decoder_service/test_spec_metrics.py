"""Speculative decoding on /metrics under vLLM's names (`epd_decoder_spec_decode_*`), read from the engine's
`spec_summary()` at scrape time: the counts while it is on, zeros (and no per-position samples) while it is off."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from decoder_service.metrics import DecoderMetrics
from tests.deploy.monitoring import dashboard, dashboard_metrics, exported_names

PREFIX = "epd_decoder_spec_decode_"


class FakeEngine:
    """What DecoderMetrics reads of the engine: LLMEngine.spec_summary() (SpecStats.summary(); None: off)."""

    def __init__(self, summary: dict[str, Any] | None):
        self.summary = summary

    def spec_summary(self) -> dict[str, Any] | None:
        return self.summary


def exposition(summary: dict[str, Any] | None) -> dict[str, float]:
    """sample (name with labels) -> value, of the spec_decode lines of one scrape."""
    registry = CollectorRegistry()
    DecoderMetrics(registry, dict).spec_stats = FakeEngine(summary).spec_summary
    lines = generate_latest(registry).decode().splitlines()
    return {name: float(value) for line in lines if line.startswith(PREFIX)
            for name, value in [line.rsplit(" ", 1)]}


def test_the_engines_spec_counts_are_exported_under_vllms_names() -> None:
    samples = exposition({"k": 4, "drafts": 10, "draft_tokens": 37, "accepted_tokens": 21,
                          "accepted_per_position": [9, 6, 4, 2]})
    assert samples == {f"{PREFIX}num_drafts_total": 10, f"{PREFIX}num_draft_tokens_total": 37,
                       f"{PREFIX}num_accepted_tokens_total": 21,
                       **{f'{PREFIX}num_accepted_tokens_per_pos_total{{position="{i}"}}': n
                          for i, n in enumerate([9, 6, 4, 2])}}


def test_with_speculation_off_the_counters_are_zero_and_no_position_is_exported() -> None:
    registry = CollectorRegistry()
    DecoderMetrics(registry, dict)  # an engine that never set spec_stats (or one whose spec_summary() is None)
    text = generate_latest(registry).decode()
    assert exposition(None) == {f"{PREFIX}{name}_total": 0 for name in
                                ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    per_pos = f"{PREFIX}num_accepted_tokens_per_pos_total"
    assert f"# TYPE {per_pos} counter" in text  # the family, which dashboards find; no samples
    assert not [line for line in text.splitlines() if line.startswith(per_pos)]


def test_the_dashboard_charts_the_acceptance_rate_and_each_position_from_what_a_decoder_exports() -> None:
    exprs = [t["expr"] for panel in dashboard()["panels"] for t in panel["targets"]]
    accepted, proposed = f"{PREFIX}num_accepted_tokens_total", f"{PREFIX}num_draft_tokens_total"
    assert [e for e in exprs if accepted in e and proposed in e
            and e.index(accepted) < e.index("/") < e.index(proposed)], "no panel divides accepted by proposed tokens"
    assert [e for e in exprs if f"{PREFIX}num_accepted_tokens_per_pos_total" in e and "by (position)" in e
            and f"{PREFIX}num_drafts_total" in e]
    registry = CollectorRegistry()
    DecoderMetrics(registry, dict)  # speculation off: the names must be there all the same
    queried = {name for name in dashboard_metrics() if name.startswith(PREFIX)}
    assert len(queried) == 4 and not queried - exported_names(generate_latest(registry).decode())
