"""The speculative-decoding bench's parts (no servers): its two stacks differ only in --speculative-config, its
primed prompts carry the model's own loop, the acceptance comes from two scrapes of the decoder's /metrics, and the
medians, targets and docs section."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from decoder_service.engine.spec.ngram import propose
from decoder_service.metrics import DecoderMetrics
from epd_bench import spec_compare as bench
from epd_bench.report import write_section
from epd_bench.spec_prompts import primed_prompts
from epd_models.demo import DEMO_DIR


def page(summary: dict[str, Any] | None) -> str:
    """The /metrics text of a decoder whose engine reports `summary` (SpecStats.summary())."""
    registry = CollectorRegistry()
    DecoderMetrics(registry, dict).spec_stats = lambda: summary
    return generate_latest(registry).decode()


def test_acceptance_is_read_from_the_decoders_counters_between_two_scrapes() -> None:
    before = bench.spec_counts(page({"k": 4, "drafts": 10, "draft_tokens": 40, "accepted_tokens": 20,
                                     "accepted_per_position": [8, 6, 4, 2]}))
    after = bench.spec_counts(page({"k": 4, "drafts": 30, "draft_tokens": 110, "accepted_tokens": 80,
                                    "accepted_per_position": [20, 18, 14, 8]}))
    assert after == {"num_drafts": 30, "num_draft_tokens": 110, "num_accepted_tokens": 80,
                     "pos0": 20, "pos1": 18, "pos2": 14, "pos3": 8}
    got = bench.acceptance(before, after)
    assert (got["drafts"], got["draft_tokens"], got["accepted_tokens"]) == (20, 70, 60)
    assert got["rate"] == pytest.approx(60 / 70) and got["per_position"] == pytest.approx([0.6, 0.6, 0.5, 0.3])
    off = bench.acceptance(bench.spec_counts(page(None)), bench.spec_counts(page(None)))
    assert off["rate"] is None and off["per_position"] == [] and off["draft_tokens"] == 0


def test_the_two_stacks_differ_only_in_the_speculative_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from decoder_service.cli import parse_args as decoder_args

    monkeypatch.setenv("EPD_INSECURE", "1")  # as stacks.Running starts them
    stacks = {name: bench.system(name, DEMO_DIR, 2, False, spec)
              for name, spec in ((bench.OFF, None), (bench.NGRAM, bench.SPEC_CONFIG))}
    argv = {name: next(p.argv for p in s.procs if p.name == "decoder") for name, s in stacks.items()}
    ngram = list(argv[bench.NGRAM])
    at = ngram.index("--speculative-config")
    assert ngram[at + 1] == bench.SPEC_CONFIG and "--speculative-config" not in argv[bench.OFF]
    strip = [a for a in ngram[:at] + ngram[at + 2:] if not a.isdigit()]  # ports differ
    assert strip == [a for a in argv[bench.OFF] if not a.isdigit()]
    spec = decoder_args(ngram[3:]).speculative_config  # past `python -m decoder_service.cli`
    assert spec is not None and (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 4, 4)


def test_a_primed_prompt_carries_the_models_loop_for_the_lookup_to_find() -> None:
    prompts = primed_prompts(DEMO_DIR, 4, 16, 32, seed=3)
    assert [len(p) for p in prompts] == [48] * 4 and prompts == primed_prompts(DEMO_DIR, 4, 16, 32, seed=3)
    assert primed_prompts(DEMO_DIR, 4, 16, 0, seed=3) == [p[:16] for p in prompts]
    # the greedy continuation loops: its last tokens occurred before, so the lookup proposes from the prompt alone
    assert all(propose(np.asarray(p, dtype=np.int64), 4, 4, 2) for p in prompts)


def _run(tok_s: float, tpot: float, failed: int = 0) -> dict[str, Any]:
    return {"output_tok_s": tok_s, "mean_tpot_ms": tpot, "mean_ttft_ms": 20.0, "failed": failed, "completed": 4}


RESULTS = {"1": {"off": [_run(200, 4.0), _run(210, 4.2), _run(190, 4.4)],
                 "ngram": [_run(500, 1.6), _run(480, 1.5), _run(520, 1.7)]},
           "16": {"off": [_run(900, 15.0)] * 3, "ngram": [_run(880, 15.5), _run(920, 15.2), _run(0, 0, failed=1)]}}
ACCEPTANCE = {"1": {"drafts": 300, "draft_tokens": 1100, "accepted_tokens": 770, "rate": 0.7,
                    "per_position": [0.9, 0.8, 0.7, 0.5]},
              "16": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "rate": None, "per_position": []}}


def _summary() -> dict[str, Any]:
    return {"date": "2026-12-06 03:00", "model": "demo", "cores": 2, "threads": 2, "pinned": True,
            "load_before": (1.0, 1.0, 1.0), "load_after": (2.0, 2.0, 2.0), "rounds": 3, "levels": [1, 16],
            "prefix_len": 64, "primer_len": 64, "output_len": 128, "context": 1024, "max_num_seqs": 16,
            "spec_config": bench.SPEC_CONFIG, "skipped": {}, "startup_s": 30.0, "wall_s": 120.0,
            "command": "python -m epd_bench.spec_compare", "greedy_check": {"same": True}, "results": RESULTS,
            "medians": bench.medians(RESULTS), "acceptance": ACCEPTANCE,
            "systems": {"off": [{"name": "decoder", "command": "python -m decoder_service.cli"}]}}


def test_medians_ratios_and_targets() -> None:
    s = _summary()
    assert s["medians"]["1"]["ngram"]["mean_tpot_ms"] == 1.6 and s["medians"]["16"]["ngram"]["output_tok_s"] is None
    assert s["medians"]["1"]["off"]["mean_tpot_ms"] == 4.2
    assert bench.round_ratios(RESULTS, "1", "mean_tpot_ms") == pytest.approx([1.6 / 4.0, 1.5 / 4.2, 1.7 / 4.4])
    found = {t.name: t for t in bench.targets(s)}
    assert found["spec_tpot"].value == pytest.approx(1.7 / 4.4)  # the median of the rounds' ratios
    assert found["spec_tpot"].met and found["spec_tpot"].limit == 0.7 and found["spec_tpot"].op == "<="
    assert found["spec_throughput"].value is None  # a round with a failure: not a measurement


def test_the_targets_judge_each_rounds_ratio_not_the_ratio_of_medians() -> None:
    # round 1 was busy for both stacks: per round ngram ÷ off is 1.05, 1.04, 0.90 (median 1.04), while the medians
    # (900 against 1000) would pair ngram's busy-round-like 900 with off's quiet 1000
    results = {"16": {"off": [_run(1000, 10), _run(500, 20), _run(1000, 10)],
                      "ngram": [_run(1050, 10), _run(520, 20), _run(900, 11)]}}
    s = {**_summary(), "levels": [16], "results": results, "medians": bench.medians(results)}
    assert s["medians"]["16"]["ngram"]["output_tok_s"] / s["medians"]["16"]["off"]["output_tok_s"] == pytest.approx(0.9)
    (throughput,) = [t for t in bench.targets(s) if t.name == "spec_throughput"]
    assert throughput.value == pytest.approx(1.04) and throughput.met
    assert bench.round_ratios({"16": {"off": results["16"]["off"][:2], "ngram": results["16"]["ngram"]}}, "16",
                              "output_tok_s") is None  # rounds missing on one side: not paired


def test_a_level_sends_its_waves_of_requests() -> None:
    assert bench.per_level(16) == 16 * bench.WAVES and bench.per_level(1) == 8 and bench.per_level(16, 2) == 32
    assert bench.parse_args([]).waves == bench.WAVES and bench.parse_args(["--waves", "3"]).waves == 3


def test_the_section_has_the_acceptance_goes_after_the_vllm_section_and_is_replaced_in_place(tmp_path: Path) -> None:
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text("# B\n\n<!-- vllm-bench:begin -->\nv\n<!-- vllm-bench:end -->\n\n## Hand-written\n")
    write_section(docs, bench.NAME, bench.render(_summary()), "vllm-bench")
    first = docs.read_text()
    assert first.index("<!-- vllm-bench:end -->") < first.index("<!-- spec-bench:begin -->") < first.index("## Hand")
    assert "| 1 | 200.0 | 500.0 | 2.50 | 4.20 | 1.60 | 0.39 | 0.70 | 0.90, 0.80, 0.70, 0.50 | 300 |" in first
    assert "| 1 | ngram ÷ off | 2.50, 2.29, 2.74 | 0.40, 0.36, 0.39 | |" in first
    assert "| 16 | ngram ÷ off | – | – | |" in first  # a failed round: no ratios
    assert "| 16 | 900.0 | – | – | 15.00 | – | – | – | – | 0 |" in first and "Greedy check: one prompt's" in first
    write_section(docs, bench.NAME, bench.render(_summary()), "vllm-bench")
    assert docs.read_text() == first


@pytest.mark.parametrize("argv", [["--levels", "0"], ["--levels", "17"], ["--rounds", "0"], ["--waves", "0"],
                                  ["--prefix-len", "600", "--primer-len", "400"]])
def test_bad_arguments_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(argv)
    assert refused.value.code == 2
