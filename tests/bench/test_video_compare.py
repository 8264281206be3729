"""The video comparison's pieces with fakes in place of servers: its two systems, the rounds (alternating order,
a new clip each round, the same clip for both systems), frames/s from encoder metrics, the target, the docs."""
from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from epd_bench import video_compare, video_report
from epd_bench.stacks import SystemSpec
from epd_bench.video_compare import (
    FRAMES,
    RUN_SECONDS,
    VIDEO,
    WARM_UP_SEED,
    Counters,
    build_systems,
    busy_seconds,
    counters,
    encoder_work,
    frames_per_second,
    merge_rounds,
    metric_sum,
    model_info,
    parse_args,
)

MODEL = Path("/models/bench-video")


@pytest.mark.parametrize("cores", [2, 16])
def test_two_systems_one_and_two_encoders_each_on_one_core_with_one_thread(cores: int) -> None:
    specs = {s.name: s for s in build_systems(MODEL, cores=cores, pin=True)}
    assert list(specs) == ["epd-1enc", "epd-2enc"]
    for n, spec in zip((1, 2), specs.values(), strict=True):
        encoders = [p for p in spec.procs if p.name.startswith("encoder")]
        assert len(encoders) == n and all(p.threads == 1 and p.cpus is not None and len(p.cpus) == 1
                                          for p in encoders)
        assert len({p.cpus for p in encoders}) == n  # the encoders never share a core with each other
        proxy = spec.procs[-1]
        assert proxy.argv[proxy.argv.index("--video-chunk-frames") + 1] == "16"
    unpinned = build_systems(MODEL, cores=2, pin=False)[1]
    assert [p.threads for p in unpinned.procs if p.name.startswith("encoder")] == [1, 1]


def test_metric_sum_reads_prometheus_text() -> None:
    text = ("# HELP epd_encoder_items_encoded_total x\nepd_encoder_items_encoded_total 3.0\n"
            "epd_encoder_items_encoded_created 1.7e9\nepd_encoder_encode_seconds_sum{a=\"b\"} 1.5\n"
            "epd_encoder_encode_seconds_sum{a=\"c\"} 0.5\nepd_encoder_encode_seconds_count 2.0\n")
    assert metric_sum(text, "epd_encoder_items_encoded_total") == 3.0
    assert metric_sum(text, "epd_encoder_encode_seconds_sum") == 2.0
    assert metric_sum(text, "epd_encoder_missing_total") is None
    assert counters(text) == Counters(items=3.0, call_seconds=2.0, calls=2.0, run_seconds=None)
    assert counters(text + f"{RUN_SECONDS} 1.25\n").run_seconds == 1.25


def test_frames_are_shared_out_by_the_chunks_each_encoder_encoded() -> None:
    before = {"encoder0": Counters(10.0, 4.0, 10.0, 3.0), "encoder1": Counters(7.0, 3.0, 7.0, 2.0)}
    after = {"encoder0": Counters(11.0, 5.5, 11.0, 4.5), "encoder1": Counters(8.0, 4.0, 8.0, 3.0)}
    work = encoder_work(before, after, 32)
    assert work == {"encoder0": {"frames": 16.0, "seconds": 1.5}, "encoder1": {"frames": 16.0, "seconds": 1.0}}
    assert frames_per_second(work) == pytest.approx({"encoder0": 16 / 1.5, "encoder1": 16.0})
    assert encoder_work(before, before, 32) == {}  # nothing encoded (e.g. a failed request): no sample


def test_without_run_seconds_the_work_is_worked_out_from_queued_calls() -> None:
    """Two 16-frame chunks sent at once to an encoder that runs one call at a time: the calls last 3 s and 6 s
    (the second waits for the first), so the encoder worked 6 s for 32 frames."""
    work = encoder_work({"encoder0": Counters(0.0, 0.0, 0.0, None)}, {"encoder0": Counters(2.0, 9.0, 2.0, None)}, 32)
    assert work == {"encoder0": {"frames": 32.0, "seconds": 6.0}}
    assert busy_seconds(Counters(1.0, 2.0, 1.0, None), Counters(2.0, 5.0, 2.0, None)) == 3.0  # one call: its time
    assert busy_seconds(Counters(1.0, 2.0, 1.0, 0.5), Counters(2.0, 5.0, 2.0, 2.0)) == 1.5  # run seconds win


def _result(ttft: float, ok: bool = True) -> dict[str, Any]:
    return {"completed": int(ok), "failed": int(not ok), "duration": ttft + 0.1, "successes": [ok], "ttfts": [ttft],
            "itls": [[0.01]], "e2els": [ttft + 0.1], "output_lens": [8], "input_lens": [1100], "start_times": [0.0],
            "errors": ["" if ok else "HTTP 400: video_not_supported"], "turns": [1], "cached_tokens": [0]}


class FakeRunning:
    def __init__(self, spec: SystemSpec):
        self.spec = spec


def test_rounds_alternate_send_a_new_clip_each_and_pool_ttft_and_encoder_work(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fakes for epd-bench and the encoders' /metrics: an encoder works `encode_s[its system]` seconds per request
    on its share of the video's two chunks; a run's TTFT is set by the system."""
    specs = build_systems(MODEL, cores=2, pin=True)
    ttft = {"epd-1enc": 6.0, "epd-2enc": 3.3}
    encode_s = {"epd-1enc": 5.0, "epd-2enc": 2.5}
    runs: list[tuple[str, int]] = []
    totals: dict[str, list[float]] = {}

    def fake_run(cmd: list[str], log: Path) -> dict[str, Any]:
        system, seed = cmd[cmd.index("--label") + 1], int(cmd[cmd.index("--seed") + 1])
        runs.append((system, seed))
        spec = next(s for s in specs if s.name == system)
        encoders = [p.name for p in spec.procs if p.name.startswith("encoder")]
        for name in encoders:  # 2 chunks per video, shared out evenly, one call each, run one after the other
            c = totals.setdefault(f"{system}/{name}", [0.0, 0.0, 0.0])
            calls = 2 // len(encoders)
            c[0] += calls
            c[1] += encode_s[system] / calls * sum(range(1, calls + 1))  # the k-th call waited for k - 1 before it
            c[2] += calls
        return _result(ttft[system])

    def fake_counters(spec: SystemSpec) -> dict[str, Counters]:
        return {p.name: Counters(*totals.get(f"{spec.name}/{p.name}", [0.0, 0.0, 0.0]), None)
                for p in spec.procs if p.name.startswith("encoder")}

    monkeypatch.setattr(video_compare, "run_epd_bench", fake_run)
    monkeypatch.setattr(video_compare, "encoder_counters", fake_counters)
    args = argparse.Namespace(rounds=3)
    got = video_compare.measure([FakeRunning(s) for s in specs], args, tmp_path)  # type: ignore[misc]
    seeds = [VIDEO.seed + 100 * r for r in range(3)]
    assert runs == [("epd-1enc", WARM_UP_SEED), ("epd-2enc", WARM_UP_SEED),
                    ("epd-1enc", seeds[0]), ("epd-2enc", seeds[0]), ("epd-2enc", seeds[1]), ("epd-1enc", seeds[1]),
                    ("epd-1enc", seeds[2]), ("epd-2enc", seeds[2])]
    assert got["results"]["epd-2enc"]["completed"] == 3
    assert got["results"]["epd-2enc"]["mean_ttft_ms"] == pytest.approx(3300.0)
    # the warm-up's work is left out: 3 measured videos of 32 frames
    assert got["encoder_work"]["epd-1enc"] == {"encoder0": {"frames": 3.0 * FRAMES, "seconds": 15.0}}
    assert got["frames_per_s"]["epd-2enc"] == pytest.approx({"encoder0": 16 / 2.5, "encoder1": 16 / 2.5})
    assert got["busy_from"] == ["call wall times"]
    assert "--videos-per-request 1 --video-frames 32" in got["commands"]["video32"]["epd-1enc"]
    assert f"--seed {WARM_UP_SEED}" in got["commands"]["warm-up"]["epd-2enc"]


def test_a_failed_run_counts_as_failed_and_its_error_is_kept() -> None:
    broken = {"error": "epd-bench exited 1: RuntimeError: warm-up request failed"}
    merged = merge_rounds([_result(2.0), _result(0.0, ok=False), broken])
    assert (merged["completed"], merged["failed"]) == (1, 2)
    assert merged["mean_ttft_ms"] == pytest.approx(2000.0)
    assert "HTTP 400: video_not_supported" in merged["errors"] and broken["error"] in merged["errors"]
    assert merge_rounds([broken]) == {"completed": 0, "failed": 1, "errors": [broken["error"]]}


def summary(**overrides: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "date": "2026-12-01 09:00", "model": "bench-video", "cores": 2, "load_before": (1.0, 0.5, 0.25),
        "load_after": (1.5, 0.75, 0.5),
        "wall_s": 180.0, "rounds": 6, "frames": 32, "frame_size": 224, "chunk_frames": 16, "pinning": "split",
        "skipped": {}, "warm_up_errors": {},
        "model_info": {"family": "qwen2_vl", "vision_depth": 6, "vision_width": 768, "vision_mlp_ratio": 4,
                       "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "lm_hidden": 256, "lm_layers": 4,
                       "vision_params": 43_000_000, "lm_params": 3_400_000},
        "systems": {n: [{"name": "encoder0", "threads": 1, "command": f"enc {n}"},
                        {"name": "proxy", "threads": None, "command": f"proxy {n}"}] for n in ("epd-1enc", "epd-2enc")},
        "results": {"epd-1enc": merge_rounds([_result(6.0), _result(6.4)]),
                    "epd-2enc": merge_rounds([_result(3.4), _result(3.6)])},
        "encoder_work": {"epd-1enc": {"encoder0": {"frames": 64.0, "seconds": 10.0}},
                         "epd-2enc": {"encoder0": {"frames": 32.0, "seconds": 5.5},
                                      "encoder1": {"frames": 32.0, "seconds": 5.0}}},
        "frames_per_s": {"epd-1enc": {"encoder0": 6.4}, "epd-2enc": {"encoder0": 32 / 5.5, "encoder1": 6.4}},
        "workload": {"name": "video32", "title": "one new video at a time"},
        "commands": {"warm-up": {"epd-1enc": "epd-bench --seed 16"}, "video32": {"epd-1enc": "epd-bench --seed 517"}},
    }
    return s | overrides


def test_target_is_the_two_encoder_ttft_over_the_one_encoder_ttft() -> None:
    (t,) = video_report.targets(summary())
    assert t.value == pytest.approx(3500.0 / 6200.0) and t.met and t.limit == 0.65
    s = summary()
    s["results"]["epd-2enc"] = merge_rounds([{"error": "boom"}])
    (missing,) = video_report.targets(s)
    assert missing.value is None and missing.verdict() == "not measured"


def test_docs_section_goes_after_the_prefix_section_then_is_replaced_in_place(tmp_path: Path) -> None:
    docs = tmp_path / "BENCHMARKS.md"
    prefix = "<!-- prefix-bench:begin -->\nprefix\n<!-- prefix-bench:end -->"
    docs.write_text(f"# B\n\n{prefix}\n\n## Hand-written\n")
    video_report.write_docs(summary(), docs)
    text = docs.read_text()
    assert text.index(prefix) < text.index(video_report.BEGIN) < text.index(video_report.END) < \
        text.index("## Hand-written")
    assert "| one new 32-frame video: mean TTFT, epd-2enc ÷ epd-1enc | 0.565 | <= 0.65 | met |" in text
    assert "| epd-2enc | encoder1 | 32 | 5.00 | 6.4 |" in text and "| epd-1enc | 2 / 0 | 6,200.0 |" in text
    assert "16 temporal patches, 1024 LM tokens" in text and "epd-bench --seed 517" in text
    assert "load average 1.00, 0.50, 0.25 before the run and 1.50, 0.75, 0.50 after" in text
    assert "1 torch thread(s)" in text and "worked out from `epd_encoder_encode_seconds`" in text
    video_report.write_docs(summary(busy_from=["run seconds"]), docs)
    assert "(`epd_encoder_run_seconds`: the time its encode thread ran, waiting excluded)" in docs.read_text()
    video_report.write_docs(summary(date="2026-12-02 10:00"), docs)
    again = docs.read_text()
    assert again.count(video_report.BEGIN) == 1 and "2026-12-02 10:00" in again and "2026-12-01 09:00" not in again
    assert again.endswith("## Hand-written\n")


def test_failures_are_shown_with_their_first_error(tmp_path: Path) -> None:
    s = summary(warm_up_errors={"epd-2enc": "epd-bench exited 1"})
    s["results"]["epd-2enc"] = merge_rounds([_result(0.0, ok=False)])
    docs = tmp_path / "B.md"
    docs.write_text("# B\n")
    video_report.write_docs(s, docs)
    text = docs.read_text()
    assert "**epd-2enc: warm-up failed** — epd-bench exited 1" in text
    assert "**epd-2enc: 1 failed** — first error: HTTP 400: video_not_supported" in text
    assert "| epd-2enc | 0 / 1 |" in text and text.rstrip().endswith(video_report.END)


def test_model_info_splits_vision_and_lm_parameters_from_the_safetensors_header(tmp_path: Path) -> None:
    vision = {"depth": 6, "embed_dim": 768, "mlp_ratio": 4, "patch_size": 14, "temporal_patch_size": 2,
              "spatial_merge_size": 2}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": vision,
                                                      "text_config": {"hidden_size": 8, "num_hidden_layers": 2}}))
    header = json.dumps({"__metadata__": {}, "visual.blocks.0.w": {"shape": [10, 10]}, "model.layers.0.w":
                         {"shape": [3, 4]}, "lm_head.weight": {"shape": [5]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    info = model_info(tmp_path)
    assert (info["vision_params"], info["lm_params"], info["vision_depth"], info["merge_size"]) == (100, 17, 6, 2)


def test_bad_flags_are_usage_errors() -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--rounds", "0"])
    assert exc.value.code == 2
    assert parse_args([]).rounds == 6 and parse_args([]).model == "bench-video"

