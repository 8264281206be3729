"""The prefix-cache comparison's pieces that need no servers: its systems, the ratios, the premise, the docs section."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from epd_bench import prefix_compare
from epd_bench.prefix_compare import _median_ms, build_systems, model_info, parse_args
from epd_bench.report import write_section

BEGIN, END = "<!-- prefix-bench:begin -->", "<!-- prefix-bench:end -->"

MODEL = Path("/models/bench-lm")


def test_four_systems_differ_only_in_the_cache_flag() -> None:
    specs = {s.name: s for s in build_systems(MODEL, ("epd", "aggregated"), cores=2, pin=True)}
    assert list(specs) == ["epd-cache", "epd-nocache", "aggregated-cache", "aggregated-nocache"]
    for name, spec in specs.items():
        (dec,) = [p for p in spec.procs if p.name == "decoder"]
        flags = dec.argv[dec.argv.index("--log-level") + 2:]
        assert flags == (("--max-num-seqs", "8") + (("--prefix-cache-bytes", "0") if "nocache" in name else ()))
    assert [p.name for p in specs["epd-cache"].procs] == ["encoder0", "decoder", "proxy"]
    assert "--aggregated" in specs["aggregated-nocache"].procs[0].argv


def _run(ttft2plus_ms: float | None, req_s: float) -> dict[str, Any]:
    return {"completed": 8, "failed": 0, "mean_ttft_ms_turn2plus": ttft2plus_ms, "request_throughput": req_s,
            "output_throughput": 16 * req_s}


def summary(**overrides: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "date": "2026-12-01 09:00", "model": "bench-lm", "cores": 2, "load_before": (1.0, 0.5, 0.25), "wall_s": 360.0,
        "load_after": (1.0, 0.5, 0.25),
        "rounds": 2, "skipped": {},
        "model_info": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
                       "intermediate_size": 1536, "lm_params": 24_566_272},
        "systems": {n: [{"name": "decoder", "command": f"dec {n}"}] for n in
                    ("epd-cache", "epd-nocache", "aggregated-cache", "aggregated-nocache")},
        "results": {"multi-turn": {"epd-cache": _run(200.0, 1.0), "epd-nocache": _run(1000.0, 0.5),
                                   "aggregated-cache": _run(400.0, 1.0), "aggregated-nocache": _run(1000.0, 0.5)},
                    "shared-prefix": {"epd-cache": _run(None, 3.0), "epd-nocache": _run(None, 1.5),
                                      "aggregated-cache": _run(None, 2.0), "aggregated-nocache": _run(None, 1.6)}},
        "calibration": {"epd-nocache": {"one_word_ms": 50.0, "first_turn_ms": 800.0, "first_turn_tokens": 740},
                        "aggregated-nocache": {"one_word_ms": 40.0, "first_turn_ms": 200.0, "first_turn_tokens": 740}},
        "workloads": {"multi-turn": {"title": "4 turns"}, "shared-prefix": {"title": "one system prompt"}},
        "commands": {"multi-turn": {"epd-cache": "epd-bench --dataset multi-turn"}},
    }
    return s | overrides


def test_targets_are_on_off_ratios_per_mode() -> None:
    got = {t.name: t for t in prefix_compare.targets(summary())}
    assert got["epd_multi_turn_ttft_turn2plus"].value == pytest.approx(0.2) and got["epd_multi_turn_ttft_turn2plus"].met
    assert got["aggregated_multi_turn_ttft_turn2plus"].value == pytest.approx(0.4)
    assert got["aggregated_multi_turn_ttft_turn2plus"].verdict() == "**missed by 0.10**"
    assert got["epd_shared_prefix_throughput"].value == pytest.approx(2.0) and got["epd_shared_prefix_throughput"].met
    assert not got["aggregated_shared_prefix_throughput"].met  # 1.25 < 1.5
    assert got["epd_prefill_vs_overhead"].value == pytest.approx(15.0)  # (800 - 50) / 50
    assert got["aggregated_prefill_vs_overhead"].value == pytest.approx(4.0) and not got["aggregated_prefill_vs_overhead"].met


def test_a_missing_or_failed_system_is_not_measured() -> None:
    s = summary(calibration={})
    s["results"]["multi-turn"]["epd-nocache"] = {"completed": 0, "failed": "?"}
    got = {t.name: t for t in prefix_compare.targets(s)}
    assert got["epd_multi_turn_ttft_turn2plus"].value is None and got["epd_prefill_vs_overhead"].verdict() == "not measured"
    only_epd = summary(systems={"epd-cache": [], "epd-nocache": []})
    assert {t.name.split("_")[0] for t in prefix_compare.targets(only_epd)} == {"epd"}


def test_docs_section_is_replaced_between_its_markers(tmp_path: Path) -> None:
    docs = tmp_path / "BENCHMARKS.md"
    other = "<!-- epd-bench:begin -->\nthe other tool's\n<!-- epd-bench:end -->\n"
    docs.write_text(f"# B\n\n{other}\n{BEGIN}\nplaceholder\n{END}\n\n## Hand-written\n")
    write_section(docs, "prefix-bench", prefix_compare.render(summary()))
    text = docs.read_text()
    assert other in text and text.endswith(f"{END}\n\n## Hand-written\n") and "placeholder" not in text
    assert "| epd: mean TTFT of turns ≥ 2, cache on ÷ off | 0.200 | <= 0.3 | met |" in text
    assert "hidden 512, 8 layers, 8 query and 2 K/V heads, MLP 1536: 24.6M parameters" in text
    assert "| epd | 50.0 | 800.0 | 740 | 15.0 |" in text and "epd-bench --dataset multi-turn" in text
    write_section(docs, "prefix-bench", prefix_compare.render(summary(date="2026-12-02 10:00")))
    again = docs.read_text()
    assert again.count(BEGIN) == 1 and "2026-12-02 10:00" in again and "2026-12-01 09:00" not in again


def test_premise_medians_leave_out_the_request_that_encoded_the_image() -> None:
    result = {"ttfts": [2.0, 0.5, 0.7, 0.6, 9.0], "input_lens": [740, 740, 741, 740, 0],
              "successes": [True, True, True, True, False]}
    assert _median_ms(result, skip_first=True) == (pytest.approx(600.0), 740)
    assert _median_ms(result, skip_first=False)[0] == pytest.approx(650.0)
    assert _median_ms({"ttfts": [], "input_lens": [], "successes": []}, skip_first=True) == (None, 0)


def test_model_info_counts_the_language_model_from_the_safetensors_header(tmp_path: Path) -> None:
    text = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 16}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text}))
    header = json.dumps({"__metadata__": {}, "language_model.a": {"shape": [8, 16]}, "language_model.b": {"shape": [3]},
                         "vision_tower.c": {"shape": [100, 100]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert model_info(tmp_path) == {**text, "lm_params": 131}


@pytest.mark.parametrize("bad", [["--modes", "epd,disagg"], ["--rounds", "0"], ["--scale", "0"]])
def test_bad_flags_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(bad)
    assert exc.value.code == 2
