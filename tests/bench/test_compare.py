"""The comparison's pieces that need no servers: core pinning, commands, targets, the docs section."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from epd_bench import compare
from epd_bench.compare import OVERHEAD, WORKLOADS, epd_bench_cmd, num_prompts
from epd_bench.stacks import aggregated, core_layout, epd, transformers_serve

MODEL = Path("/models/bench")


def test_core_layout_gives_encoders_their_own_cores_first() -> None:
    assert core_layout(1, 2) == ((0,), [(1,)])
    assert core_layout(2, 2) == ((0,), [(1,), (0,)])  # no spare core: the second encoder shares core 0
    assert core_layout(2, 4) == ((0, 3), [(1,), (2,)])  # spare cores go to the decoder


def test_epd_system_is_pinned_with_one_thread_per_core() -> None:
    spec = epd(MODEL, 2, cores=2, pin=True)
    procs = {p.name: p for p in spec.procs}
    assert [p.name for p in spec.procs] == ["encoder0", "encoder1", "decoder", "proxy"]
    assert (procs["encoder0"].cpus, procs["encoder1"].cpus, procs["decoder"].cpus) == ((1,), (0,), (0,))
    assert {p.threads for n, p in procs.items() if n != "proxy"} == {1}
    assert procs["proxy"].cpus is None and spec.url == procs["proxy"].url
    assert procs["encoder0"].command()[:5] == ["taskset", "-c", "1", "env", "OMP_NUM_THREADS=1"]
    proxy_argv = procs["proxy"].argv
    i = proxy_argv.index("--encode-servers-urls")
    assert proxy_argv[i + 1 : i + 3] == (procs["encoder0"].url, procs["encoder1"].url)
    assert spec.decoder_url == procs["decoder"].url


def test_unpinned_epd_uses_the_launcher_thread_count() -> None:
    spec = epd(MODEL, 1, cores=4, pin=False)
    assert all(p.cpus is None for p in spec.procs)
    assert [p.threads for p in spec.procs] == [2, 2, None]
    assert spec.procs[0].command()[0] == "env"


def test_one_process_systems_get_every_core() -> None:
    agg = aggregated(MODEL, cores=2, pin=True)
    dec, proxy = agg.procs
    assert (dec.cpus, dec.threads) == ((0, 1), 2) and "--aggregated" in dec.argv and "--aggregated" in proxy.argv
    ts = transformers_serve(Path("/venv/bin/transformers"), MODEL, eos_id=2, cores=2, pin=True)
    (proc,) = ts.procs
    assert (proc.cpus, proc.threads) == ((0, 1), 2) and ("HF_HUB_OFFLINE", "1") in proc.env
    assert ts.model == str(MODEL) and not ts.ignore_eos and ts.openai_extra == {"logit_bias": {"2": -100.0}}


def test_epd_bench_commands(tmp_path: Path) -> None:
    repeat = WORKLOADS[0]
    agg = aggregated(MODEL, 2, True)
    assert num_prompts(agg, repeat, scale=0.5, rounds=2) == round(repeat.num_prompts / 4)
    cmd = epd_bench_cmd(agg, repeat, 7, 101, tmp_path, "r.json")
    assert cmd[cmd.index("--num-prompts") + 1] == "7" and cmd[cmd.index("--seed") + 1] == "101"
    assert "--ignore-eos" in cmd and cmd[cmd.index("--base-url") + 1] == agg.url
    ts = transformers_serve(Path("/t"), MODEL, 2, 2, True)
    assert num_prompts(ts, repeat, scale=1.0, rounds=2) == repeat.slow_prompts // 2  # capped: it is slow
    cmd = epd_bench_cmd(ts, repeat, 3, 1, tmp_path, "r.json")
    assert json.loads(cmd[cmd.index("--extra-body") + 1]) == ts.openai_extra and "--ignore-eos" not in cmd
    direct = epd_bench_cmd(agg, OVERHEAD, 5, 4, tmp_path, "d.json", direct=True)
    assert direct[direct.index("--backend") + 1] == "epd-decoder"
    assert direct[direct.index("--base-url") + 1] == agg.decoder_url


def _result(mean_ttft_ms: float, out_tps: float) -> dict[str, Any]:
    ttfts = [mean_ttft_ms / 1000.0] * 3
    r = {"completed": 3, "failed": 0, "request_throughput": 1.0, "output_throughput": out_tps,
         "ttfts": ttfts, "tpots": [0.01] * 3, "itls": [[0.01, 0.02]] * 3, "e2els": [t + 0.1 for t in ttfts],
         "start_times": [0.0, 0.5, 1.0], "successes": [True] * 3}
    return r | {f"{s}_{m}_ms": mean_ttft_ms for s in ("mean", "median", "p90", "p99") for m in ("ttft", "tpot",
                                                                                              "itl", "e2el")}


def summary(**overrides: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "date": "2026-11-30 15:00", "cores": 2, "load_before": (0.5, 0.4, 0.3), "load_after": (0.6, 0.4, 0.3),
        "wall_s": 420.0, "rounds": 2, "pinning": "split",
        "results": {"repeat50": {"aggregated": _result(1000, 10), "epd-1enc": _result(500, 10),
                                 "epd-2enc": _result(700, 10)},
                    "images4": {"epd-1enc": _result(2000, 5), "epd-2enc": _result(1200, 5)},
                    "text": {"aggregated": _result(50, 400), "epd-1enc": _result(50, 380),
                             "epd-2enc": _result(50, 200), "transformers-serve": {"completed": 0, "failed": 8}}},
        "overhead": {"system": "epd-1enc", "rounds": 2, "ttfts": {"proxy": [0.012, 0.013], "decoder": [0.010, 0.011]},
                     "median_ttft_ms": {"proxy": 12.5, "decoder": 10.5}, "mean_ttft_ms": {"proxy": 12.5, "decoder": 10.5},
                     "overhead_ms": 2.0, "paired_median_ms": 1.75, "commands": {"proxy": "epd-bench --base-url P", "decoder": "epd-bench D"}},
        "skipped": {"transformers-serve": "not installed: x"},
        "systems": {"epd-1enc": [{"name": "decoder", "cpus": (0,), "threads": 1, "command": "taskset -c 0 dec"},
                                 {"name": "proxy", "cpus": None, "threads": None, "command": "proxy"}]},
        "commands": {"repeat50": {"aggregated": "epd-bench --seed 1"}},
    }
    return s | overrides


def test_targets_are_the_issue_ratios() -> None:
    got = {t.name: t for t in compare.targets(summary())}
    assert got["repeat50_ttft_epd-1enc_vs_aggregated"].value == pytest.approx(0.5)
    assert got["repeat50_ttft_epd-1enc_vs_aggregated"].met
    assert got["repeat50_ttft_epd-2enc_vs_aggregated"].verdict() == "**missed by 0.10**"
    assert got["images4_ttft_2enc_vs_1enc"].value == pytest.approx(0.6) and got["images4_ttft_2enc_vs_1enc"].met
    assert got["text_throughput_epd-1enc_vs_aggregated"].value == pytest.approx(0.95)
    assert not got["text_throughput_epd-2enc_vs_aggregated"].met
    assert got["proxy_overhead_ms"].met  # 2.0 <= 2.0
    missing = {t.name: t for t in compare.targets(summary(overhead=None, results={"text": {}}))}
    assert missing["proxy_overhead_ms"].verdict() == "not measured" and not missing["proxy_overhead_ms"].met
    assert "missed by 0.10" in compare.format_targets(compare.targets(summary()))


BEGIN, END = "<!-- epd-bench:begin -->", "<!-- epd-bench:end -->"
DOC = "# Benchmarks\n\nIntro text.\n\n## Old section\n\nhand-written\n"


def test_docs_section_goes_after_the_intro_and_is_replaced_in_place(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    docs, plots = tmp_path / "docs" / "BENCHMARKS.md", tmp_path / "docs" / "bench"
    docs.parent.mkdir()
    docs.write_text(DOC)
    args = argparse.Namespace(docs=docs, plots_dir=plots)
    docs.write_text(compare.render_docs(summary(), args))
    first = docs.read_text()
    assert first.startswith("# Benchmarks\n\nIntro text.\n\n" + BEGIN)
    assert first.endswith(END + "\n\n## Old section\n\nhand-written\n")
    assert "![repeat50_latency_cdf](bench/repeat50_latency_cdf.png)" in first
    assert "| **proxy − decoder** | | **2.00** |" in first and "per-prompt differences (proxy − decoder) is **1.75 ms**" in first and "**transformers-serve: left out**" in first
    assert "taskset -c 0 dec &" in first and "epd-bench --seed 1" in first
    assert "p99 inter-token latency: aggregated 1000 ms, epd-1enc 500 ms, epd-2enc 700 ms" in first
    for png in ("repeat50_latency_cdf", "repeat50_ttft_over_time", "images4_latency_cdf", "text_latency_cdf",
                "overhead_ttft_cdf"):
        assert (plots / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setattr(compare, "plots", lambda summary, plots_dir: {})  # drawn above; keeps the test fast
    docs.write_text(compare.render_docs(summary(date="2026-12-01 09:00"), args))
    second = docs.read_text()
    assert second.count(BEGIN) == 1 and "2026-12-01 09:00" in second and "2026-11-30 15:00" not in second
    assert second.split(END)[1] == first.split(END)[1]  # the hand-written part is untouched


def test_rounds_merge_into_one_result() -> None:
    from epd_bench.loads import merge_results

    def part(ttfts: list[float], duration: float) -> dict[str, Any]:
        n = len(ttfts)
        return {"successes": [True] * n, "ttfts": ttfts, "itls": [[0.01]] * n, "e2els": [t + 0.01 for t in ttfts],
                "output_lens": [2] * n, "input_lens": [10] * n, "start_times": [0.0] * n, "errors": [""] * n,
                "duration": duration}

    merged = merge_results([part([0.1, 0.3], 2.0), part([0.2], 1.0)])
    assert merged["completed"] == 3 and merged["duration"] == 3.0 and merged["rounds"] == 2
    assert merged["output_throughput"] == pytest.approx(6 / 3.0) and merged["mean_ttft_ms"] == pytest.approx(200.0)
    assert merged["start_times"] == [0.0, 0.0, 2.0]  # the second round starts where the first ended


def test_baseline_decoder_flags_run_each_system_again_beside_it_with_those_flags(tmp_path: Path) -> None:
    args = compare.parse_args(["--systems", "aggregated,epd-1enc", "--transformers-serve", str(tmp_path / "none"),
                               "--baseline-decoder-flags", "--max-prefill-tokens 32 --cpu-exact-linear"])
    specs, _ = compare.build_systems(args, MODEL, pin=True)
    assert [s.name for s in specs] == ["aggregated", "aggregated-base", "epd-1enc", "epd-1enc-base"]
    for spec in specs:
        (dec,) = [p for p in spec.procs if p.name == "decoder"]
        assert (dec.argv[-3:] == ("--max-prefill-tokens", "32", "--cpu-exact-linear")) == spec.name.endswith("-base")
