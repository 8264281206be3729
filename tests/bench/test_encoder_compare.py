"""The 2-encoder ÷ 1-encoder comparisons (video, audio) with fakes in place of servers: their two systems, the rounds
(alternating order, a new item each round, the same for both systems), each encoder's rate from its /metrics, the
target, the docs section, the model info each reads from a checkpoint."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from epd_bench import encoder_compare, loads
from epd_bench.audio_compare import CASE as AUDIO
from epd_bench.encoder_compare import (
    RUN_SECONDS,
    WARM_UP_SEED,
    Case,
    Counters,
    build_systems,
    busy_seconds,
    counters,
    encoder_work,
    measure,
    metric_sum,
    parse_args,
    rates,
    render,
    targets,
)
from epd_bench.loads import merge_rounds
from epd_bench.report import write_section
from epd_bench.stacks import SystemSpec
from epd_bench.video_compare import CASE as VIDEO

CASES = pytest.mark.parametrize("case", [VIDEO, AUDIO], ids=["video", "audio"])


@CASES
@pytest.mark.parametrize("cores", [2, 16])
def test_two_systems_one_and_two_encoders_each_on_one_core_with_one_thread(case: Case, cores: int) -> None:
    specs = {s.name: s for s in build_systems(case, Path("/m"), cores=cores, pin=True)}
    assert list(specs) == ["epd-1enc", "epd-2enc"]
    for n, spec in zip((1, 2), specs.values(), strict=True):
        encoders = [p for p in spec.procs if p.name.startswith("encoder")]
        assert len(encoders) == n and all(p.threads == 1 and p.cpus is not None and len(p.cpus) == 1
                                          for p in encoders)
        assert len({p.cpus for p in encoders}) == n  # the encoders never share a core with each other
        assert spec.procs[-1].argv[-2:] == case.proxy_flags  # the proxy's chunking
    assert [p.threads for p in build_systems(case, Path("/m"), 2, False)[1].procs if p.name.startswith("enc")] == [1, 1]


def test_metric_sum_reads_prometheus_text() -> None:
    text = ("# HELP epd_encoder_items_encoded_total x\nepd_encoder_items_encoded_total 3.0\n"
            "epd_encoder_items_encoded_created 1.7e9\nepd_encoder_encode_seconds_sum{a=\"b\"} 1.5\n"
            "epd_encoder_encode_seconds_sum{a=\"c\"} 0.5\nepd_encoder_encode_seconds_count 2.0\n")
    assert metric_sum(text, "epd_encoder_items_encoded_total") == 3.0
    assert metric_sum(text, "epd_encoder_encode_seconds_sum") == 2.0
    assert metric_sum(text, "epd_encoder_missing_total") is None
    assert counters(text) == Counters(items=3.0, call_seconds=2.0, calls=2.0, run_seconds=None)
    assert counters(text + f"{RUN_SECONDS} 1.25\n").run_seconds == 1.25


def test_units_are_shared_out_by_the_chunks_each_encoder_encoded() -> None:
    before = {"encoder0": Counters(10.0, 4.0, 10.0, 3.0), "encoder1": Counters(7.0, 3.0, 7.0, 2.0)}
    after = {"encoder0": Counters(11.0, 5.5, 11.0, 4.5), "encoder1": Counters(8.0, 4.0, 8.0, 3.0)}
    work = encoder_work(before, after, 32)
    assert work == {"encoder0": {"units": 16.0, "seconds": 1.5}, "encoder1": {"units": 16.0, "seconds": 1.0}}
    assert rates(work) == pytest.approx({"encoder0": 16 / 1.5, "encoder1": 16.0})
    assert rates({"encoder0": {"units": 0.0, "seconds": 0.0}}) == {"encoder0": None}
    assert encoder_work(before, before, 32) == {}  # nothing encoded (e.g. a failed request): no sample


def test_without_run_seconds_the_work_is_worked_out_from_queued_calls() -> None:
    """Two chunks sent at once to an encoder that runs one call at a time: the calls last 3 s and 6 s (the second
    waits for the first), so the encoder worked 6 s."""
    work = encoder_work({"encoder0": Counters(0.0, 0.0, 0.0, None)}, {"encoder0": Counters(2.0, 9.0, 2.0, None)}, 32)
    assert work == {"encoder0": {"units": 32.0, "seconds": 6.0}}
    assert busy_seconds(Counters(1.0, 2.0, 1.0, None), Counters(2.0, 5.0, 2.0, None)) == 3.0  # one call: its time
    assert busy_seconds(Counters(1.0, 2.0, 1.0, 0.5), Counters(2.0, 5.0, 2.0, 2.0)) == 1.5  # run seconds win


def _result(ttft: float, ok: bool = True) -> dict[str, Any]:
    return {"completed": int(ok), "failed": int(not ok), "duration": ttft + 0.1, "successes": [ok], "ttfts": [ttft],
            "itls": [[0.01]], "e2els": [ttft + 0.1], "output_lens": [8], "input_lens": [1100], "start_times": [0.0],
            "errors": ["" if ok else "HTTP 400: video_not_supported"], "turns": [1], "cached_tokens": [0]}


class FakeRunning:
    def __init__(self, spec: SystemSpec):
        self.spec = spec


@CASES
def test_rounds_alternate_send_a_new_item_each_and_pool_ttft_and_encoder_work(
        case: Case, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fakes for epd-bench and the encoders' /metrics: an encoder works `encode_s[its system]` seconds per request
    on its share of the item's two chunks; a run's TTFT is set by the system."""
    specs = build_systems(case, Path("/m"), cores=2, pin=True)
    ttft, encode_s = {"epd-1enc": 6.0, "epd-2enc": 3.3}, {"epd-1enc": 5.0, "epd-2enc": 2.5}
    runs: list[tuple[str, int]] = []
    totals: dict[str, list[float]] = {}

    def fake_run(cmd: list[str], log: Path) -> dict[str, Any]:
        system, seed = cmd[cmd.index("--label") + 1], int(cmd[cmd.index("--seed") + 1])
        runs.append((system, seed))
        encoders = [p.name for p in next(s for s in specs if s.name == system).procs if p.name.startswith("encoder")]
        for name in encoders:  # 2 chunks per item, shared out evenly, one call each, run one after the other
            c, calls = totals.setdefault(f"{system}/{name}", [0.0, 0.0, 0.0]), 2 // len(encoders)
            c[0], c[2] = c[0] + calls, c[2] + calls
            c[1] += encode_s[system] / calls * sum(range(1, calls + 1))  # the k-th call waited for k - 1 before it
        return _result(ttft[system])

    def fake_counters(spec: SystemSpec) -> dict[str, Counters]:
        return {p.name: Counters(*totals.get(f"{spec.name}/{p.name}", [0.0, 0.0, 0.0]), None)
                for p in spec.procs if p.name.startswith("encoder")}

    monkeypatch.setattr(encoder_compare, "run_one", fake_run)
    monkeypatch.setattr(loads, "run_one", fake_run)
    monkeypatch.setattr(encoder_compare, "encoder_counters", fake_counters)
    got = measure(case, [FakeRunning(s) for s in specs], 3, tmp_path)  # type: ignore[misc]
    seeds = [case.workload.seed + 100 * r for r in range(3)]
    assert runs == [("epd-1enc", WARM_UP_SEED), ("epd-2enc", WARM_UP_SEED),
                    ("epd-1enc", seeds[0]), ("epd-2enc", seeds[0]), ("epd-2enc", seeds[1]), ("epd-1enc", seeds[1]),
                    ("epd-1enc", seeds[2]), ("epd-2enc", seeds[2])]
    assert got["results"]["epd-2enc"]["completed"] == 3
    assert got["results"]["epd-2enc"]["mean_ttft_ms"] == pytest.approx(3300.0)
    # the warm-up's work is left out: 3 measured items
    assert got["encoder_work"]["epd-1enc"] == {"encoder0": {"units": 3.0 * case.units, "seconds": 15.0}}
    assert got["rates"]["epd-2enc"] == pytest.approx({"encoder0": case.units / 2 / 2.5, "encoder1": case.units / 5})
    assert got["busy_from"] == ["call wall times"]
    assert " ".join(case.workload.flags[2:6]) in got["commands"][case.workload.name]["epd-1enc"]
    assert f"--seed {WARM_UP_SEED}" in got["commands"]["warm-up"]["epd-2enc"]


def test_a_failed_run_counts_as_failed_and_its_error_is_kept() -> None:
    broken = {"error": "epd-bench exited 1: RuntimeError: warm-up request failed"}
    merged = merge_rounds([_result(2.0), _result(0.0, ok=False), broken])
    assert (merged["completed"], merged["failed"]) == (1, 2)
    assert merged["mean_ttft_ms"] == pytest.approx(2000.0)
    assert "HTTP 400: video_not_supported" in merged["errors"] and broken["error"] in merged["errors"]
    assert merge_rounds([broken]) == {"completed": 0, "failed": 1, "errors": [broken["error"]]}


INFO = {"video": {"family": "qwen2_vl", "vision_depth": 6, "vision_width": 768, "vision_mlp_ratio": 4,
                  "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "lm_hidden": 256, "lm_layers": 4,
                  "vision_params": 43_000_000, "lm_params": 3_400_000},
        "audio": {"family": "qwen2_5_omni_thinker", "audio_layers": 6, "audio_width": 768, "audio_ffn": 1536,
                  "audio_heads": 12, "window_frames": 200, "lm_hidden": 256, "lm_layers": 4,
                  "audio_params": 36_000_000, "lm_params": 3_400_000}}


def summary(case: Case, **overrides: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "date": "2026-12-01 09:00", "model": case.model, "cores": 2, "load_before": (1.0, 0.5, 0.25),
        "load_after": (1.5, 0.75, 0.5), "wall_s": 180.0, "rounds": 6, "pinning": "split", "skipped": {},
        "warm_up_errors": {}, "model_info": INFO[case.kind],
        "systems": {n: [{"name": "encoder0", "threads": 1, "command": f"enc {n}"},
                        {"name": "proxy", "threads": None, "command": f"proxy {n}"}] for n in ("epd-1enc", "epd-2enc")},
        "results": {"epd-1enc": merge_rounds([_result(6.0), _result(6.4)]),
                    "epd-2enc": merge_rounds([_result(3.4), _result(3.6)])},
        "encoder_work": {"epd-1enc": {"encoder0": {"units": 64.0, "seconds": 10.0}},
                         "epd-2enc": {"encoder0": {"units": 32.0, "seconds": 5.5},
                                      "encoder1": {"units": 32.0, "seconds": 5.0}}},
        "rates": {"epd-1enc": {"encoder0": 6.4}, "epd-2enc": {"encoder0": 32 / 5.5, "encoder1": 6.4}},
        "commands": {"warm-up": {"epd-1enc": "epd-bench --seed 16"}, "w": {"epd-1enc": "epd-bench --seed 517"}},
    }
    return s | overrides


@CASES
def test_target_is_the_two_encoder_ttft_over_the_one_encoder_ttft(case: Case) -> None:
    (t,) = targets(case, summary(case))
    assert t.value == pytest.approx(3500.0 / 6200.0) and t.met and t.limit == 0.65
    assert t.what == f"{case.item}: mean TTFT, epd-2enc ÷ epd-1enc"
    s = summary(case)
    s["results"]["epd-2enc"] = merge_rounds([{"error": "boom"}])
    (missing,) = targets(case, s)
    assert missing.value is None and missing.verdict() == "not measured"


@CASES
def test_docs_section_goes_after_the_one_before_then_is_replaced_in_place(case: Case, tmp_path: Path) -> None:
    docs = tmp_path / "BENCHMARKS.md"
    before = f"<!-- {case.after}:begin -->\nbefore\n<!-- {case.after}:end -->"
    docs.write_text(f"# B\n\n{before}\n\n## Hand-written\n")
    write_section(docs, case.name, render(case, summary(case)), case.after)
    text = docs.read_text()
    assert text.index(before) < text.index(f"<!-- {case.name}:begin -->") < text.index(f"<!-- {case.name}:end -->") \
        < text.index("## Hand-written")
    assert f"| {case.item}: mean TTFT, epd-2enc ÷ epd-1enc | 0.565 | <= 0.65 | met |" in text
    assert "| epd-2enc | encoder1 | 32.0 | 5.00 | 6.4 |" in text and "| epd-1enc | 2 / 0 | 6,200.0 |" in text
    assert ("1024 LM tokens" if case.kind == "video" else "60 windows, 3000 LM tokens") in text
    assert "load average 1.00, 0.50, 0.25 before the run and 1.50, 0.75, 0.50 after" in text
    assert "epd-bench --seed 517" in text and "worked out from `epd_encoder_encode_seconds`" in text
    write_section(docs, case.name, render(case, summary(case, busy_from=["run seconds"], date="2026-12-02 10:00")))
    again = docs.read_text()
    assert "(`epd_encoder_run_seconds`: the time its encode thread ran, waiting excluded)" in again
    assert again.count(f"<!-- {case.name}:begin -->") == 1 and "2026-12-02 10:00" in again
    assert "2026-12-01 09:00" not in again and again.endswith("## Hand-written\n")


def test_failures_are_shown_with_their_first_error(tmp_path: Path) -> None:
    s = summary(VIDEO, warm_up_errors={"epd-2enc": "epd-bench exited 1"})
    s["results"]["epd-2enc"] = merge_rounds([_result(0.0, ok=False)])
    text = render(VIDEO, s)
    assert "**epd-2enc: warm-up failed** — epd-bench exited 1" in text
    assert "**epd-2enc: 1 failed** — first error: HTTP 400: video_not_supported" in text
    assert "| epd-2enc | 0 / 1 |" in text and text.endswith("<!-- video-bench:end -->")


def _checkpoint(path: Path, config: dict[str, Any], shapes: dict[str, list[int]]) -> Path:
    (path / "config.json").write_text(json.dumps(config))
    header = json.dumps({"__metadata__": {}, **{k: {"shape": v} for k, v in shapes.items()}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def test_model_info_splits_tower_and_lm_parameters_from_the_safetensors_header(tmp_path: Path) -> None:
    vision = {"depth": 6, "embed_dim": 768, "mlp_ratio": 4, "patch_size": 14, "temporal_patch_size": 2,
              "spatial_merge_size": 2}
    (tmp_path / "v").mkdir()
    v = VIDEO.model_info(_checkpoint(tmp_path / "v", {"model_type": "qwen2_vl", "vision_config": vision, "text_config": {
        "hidden_size": 8, "num_hidden_layers": 2}}, {"visual.blocks.0.w": [10, 10], "model.layers.0.w": [3, 4],
                                                     "lm_head.weight": [5]}))
    assert (v["vision_params"], v["lm_params"], v["vision_depth"], v["merge_size"]) == (100, 17, 6, 2)
    (tmp_path / "a").mkdir()
    a = AUDIO.model_info(_checkpoint(tmp_path / "a", {
        "model_type": "qwen2_5_omni_thinker", "text_config": {"hidden_size": 256, "num_hidden_layers": 4},
        "audio_config": {"encoder_layers": 6, "d_model": 768, "encoder_ffn_dim": 1536, "encoder_attention_heads": 12,
                         "n_window": 100}}, {"audio_tower.conv1.weight": [768, 128, 3], "visual.x": [7],
                                             "model.audio_tower.proj.weight": [256, 768],
                                             "model.embed_tokens.weight": [100, 256], "lm_head.weight": [100, 256]}))
    assert (a["audio_params"], a["lm_params"]) == (768 * 128 * 3 + 256 * 768, 2 * 100 * 256)
    assert (a["audio_layers"], a["audio_width"], a["window_frames"]) == (6, 768, 200)


def test_the_bench_audio_preset_builds_an_omni_thinker_that_model_info_reads(tmp_path: Path) -> None:
    from dataclasses import replace

    from epd_builders.bench_model import BENCH_AUDIO_SPEC, PRESETS, build_bench

    assert PRESETS[AUDIO.model] is BENCH_AUDIO_SPEC
    narrow = replace(BENCH_AUDIO_SPEC, audio_hidden=32, audio_layers=1, audio_heads=2, text_hidden=32, text_layers=1)
    info = AUDIO.model_info(build_bench(narrow, tmp_path / "m"))
    assert info["family"] == "qwen2_5_omni_thinker" and (info["audio_layers"], info["audio_width"]) == (1, 32)
    assert info["window_frames"] == 200 and info["audio_params"] > 128 * 32 * 3 and info["lm_params"] > 0


@CASES
def test_flags_default_to_the_bench_model_and_refuse_no_rounds(case: Case, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(case, [], None)
    assert (args.model, args.rounds, args.pinning, args.no_docs) == (case.model, 6, "split", False)
    assert args.out_dir.parts[-2:] == ("runs", f"bench-{case.kind}") and args.docs.name == "BENCHMARKS.md"
    for bad in (["--rounds", "0"], ["--round", "3"]):  # no abbreviations
        with pytest.raises(SystemExit) as exc:
            parse_args(case, bad, None)
        assert exc.value.code == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
