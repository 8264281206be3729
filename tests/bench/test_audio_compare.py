"""The audio comparison's pure parts, with fakes in place of servers: its arguments, its two systems, the rounds (a
new 120 s clip each, the same for both systems), audio seconds per second from encoder metrics, the target, the docs."""
from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from epd_bench import audio_compare, audio_report, video_compare
from epd_bench.audio_compare import (
    AUDIO,
    AUDIO_SECONDS,
    audio_per_second,
    audio_work,
    build_systems,
    model_info,
    parse_args,
)
from epd_bench.stacks import SystemSpec
from epd_bench.video_compare import WARM_UP_SEED, Counters, encoder_work, merge_rounds

MODEL = Path("/models/bench-audio")


def test_arguments_default_to_the_bench_model_and_refuse_no_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args([])
    assert (args.model, args.rounds, args.pinning, args.no_docs) == ("bench-audio", 6, "split", False)
    assert args.out_dir.parts[-2:] == ("runs", "bench-audio") and args.docs.name == "BENCHMARKS.md"
    assert parse_args(["--rounds", "4", "--no-docs", "--pinning", "none"]).rounds == 4
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err


def test_two_systems_whose_proxies_cut_clips_into_30_s_chunks() -> None:
    specs = {s.name: s for s in build_systems(MODEL, cores=2, pin=True)}
    assert list(specs) == ["epd-1enc", "epd-2enc"]
    for n, spec in zip((1, 2), specs.values(), strict=True):
        encoders = [p for p in spec.procs if p.name.startswith("encoder")]
        assert len(encoders) == n and all(p.threads == 1 for p in encoders) and len({p.cpus for p in encoders}) == n
        proxy = spec.procs[-1]
        assert proxy.argv[proxy.argv.index("--audio-chunk-seconds") + 1] == "30"
    assert "--audios-per-request 1 --audio-seconds 120" in " ".join(AUDIO.flags)


def test_audio_seconds_are_shared_out_by_the_chunks_each_encoder_encoded() -> None:
    before = {"encoder0": Counters(0.0, 0.0, 0.0, 1.0), "encoder1": Counters(0.0, 0.0, 0.0, 0.0)}
    after = {"encoder0": Counters(2.0, 9.0, 2.0, 7.0), "encoder1": Counters(2.0, 8.0, 2.0, 5.0)}
    work = audio_work(encoder_work(before, after, AUDIO_SECONDS))
    assert work == {"encoder0": {"audio_s": 60.0, "seconds": 6.0}, "encoder1": {"audio_s": 60.0, "seconds": 5.0}}
    assert audio_per_second(work) == pytest.approx({"encoder0": 10.0, "encoder1": 12.0})
    assert audio_per_second({"encoder0": {"audio_s": 0.0, "seconds": 0.0}}) == {"encoder0": None}


def _result(ttft: float, ok: bool = True) -> dict[str, Any]:
    return {"completed": int(ok), "failed": int(not ok), "duration": ttft + 0.1, "successes": [ok], "ttfts": [ttft],
            "itls": [[0.01]], "e2els": [ttft + 0.1], "output_lens": [8], "input_lens": [3020], "start_times": [0.0],
            "errors": ["" if ok else "HTTP 400: audio_not_supported"], "turns": [1], "cached_tokens": [0]}


class FakeRunning:
    def __init__(self, spec: SystemSpec):
        self.spec = spec


def test_rounds_alternate_send_a_new_clip_each_and_pool_ttft_and_encoder_work(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An encoder runs its share of the clip's 4 chunks for `encode_s[system]` seconds (run seconds reported)."""
    specs = build_systems(MODEL, cores=2, pin=True)
    ttft, encode_s = {"epd-1enc": 12.0, "epd-2enc": 7.0}, {"epd-1enc": 10.0, "epd-2enc": 5.0}
    runs: list[tuple[str, int]] = []
    totals: dict[str, list[float]] = {}

    def fake_run(cmd: list[str], log: Path) -> dict[str, Any]:
        system, seed = cmd[cmd.index("--label") + 1], int(cmd[cmd.index("--seed") + 1])
        runs.append((system, seed))
        encoders = [p.name for p in next(s for s in specs if s.name == system).procs if p.name.startswith("encoder")]
        for name in encoders:
            c = totals.setdefault(f"{system}/{name}", [0.0, 0.0, 0.0, 0.0])
            c[0] += 4 // len(encoders)
            c[3] += encode_s[system]
        return _result(ttft[system])

    def fake_counters(spec: SystemSpec) -> dict[str, Counters]:
        return {p.name: Counters(*totals.get(f"{spec.name}/{p.name}", [0.0, 0.0, 0.0, 0.0]))
                for p in spec.procs if p.name.startswith("encoder")}

    monkeypatch.setattr(video_compare, "run_epd_bench", fake_run)
    monkeypatch.setattr(video_compare, "encoder_counters", fake_counters)
    got = audio_compare.measure([FakeRunning(s) for s in specs], argparse.Namespace(rounds=2),  # type: ignore[misc]
                                tmp_path)
    seeds = [AUDIO.seed + 100 * r for r in range(2)]
    assert runs == [("epd-1enc", WARM_UP_SEED), ("epd-2enc", WARM_UP_SEED), ("epd-1enc", seeds[0]),
                    ("epd-2enc", seeds[0]), ("epd-2enc", seeds[1]), ("epd-1enc", seeds[1])]
    assert got["results"]["epd-2enc"]["mean_ttft_ms"] == pytest.approx(7000.0)
    assert got["encoder_work"]["epd-1enc"] == {"encoder0": {"audio_s": 240.0, "seconds": 20.0}}  # warm-up left out
    assert got["audio_per_s"]["epd-2enc"] == pytest.approx({"encoder0": 12.0, "encoder1": 12.0})
    assert got["busy_from"] == ["run seconds"]
    assert "--audios-per-request 1 --audio-seconds 120" in got["commands"]["audio120"]["epd-1enc"]


def test_model_info_reads_the_config_and_the_safetensors_header(tmp_path: Path) -> None:
    config = {"model_type": "qwen2_5_omni_thinker", "text_config": {"hidden_size": 256, "num_hidden_layers": 4},
              "audio_config": {"encoder_layers": 6, "d_model": 768, "encoder_ffn_dim": 1536,
                               "encoder_attention_heads": 12, "n_window": 100}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    header = json.dumps({"__metadata__": {}, "audio_tower.conv1.weight": {"shape": [768, 128, 3]},
                         "model.audio_tower.proj.weight": {"shape": [256, 768]}, "visual.x": {"shape": [7]},
                         "model.embed_tokens.weight": {"shape": [100, 256]}, "lm_head.weight": {"shape": [100, 256]}})
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    info = model_info(tmp_path)
    assert (info["audio_params"], info["lm_params"]) == (768 * 128 * 3 + 256 * 768, 2 * 100 * 256)
    assert (info["audio_layers"], info["audio_width"], info["window_frames"]) == (6, 768, 200)


def summary(**overrides: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "date": "2026-12-03 09:00", "model": "bench-audio", "cores": 2, "load_before": (1.0, 0.5, 0.25),
        "load_after": (1.5, 0.75, 0.5), "wall_s": 240.0, "rounds": 4, "audio_seconds": 120, "chunk_seconds": 30,
        "pinning": "split", "skipped": {}, "warm_up_errors": {}, "busy_from": ["run seconds"],
        "model_info": {"family": "qwen2_5_omni_thinker", "audio_layers": 6, "audio_width": 768, "audio_ffn": 1536,
                       "audio_heads": 12, "window_frames": 200, "lm_hidden": 256, "lm_layers": 4,
                       "audio_params": 36_000_000, "lm_params": 3_400_000},
        "systems": {n: [{"name": "encoder0", "threads": 1, "command": f"enc {n}"},
                        {"name": "proxy", "threads": None, "command": f"proxy {n}"}] for n in ("epd-1enc", "epd-2enc")},
        "results": {"epd-1enc": merge_rounds([_result(12.0), _result(12.4)]),
                    "epd-2enc": merge_rounds([_result(7.0), _result(7.2)])},
        "encoder_work": {"epd-1enc": {"encoder0": {"audio_s": 240.0, "seconds": 20.0}},
                         "epd-2enc": {"encoder0": {"audio_s": 120.0, "seconds": 11.0},
                                      "encoder1": {"audio_s": 120.0, "seconds": 10.0}}},
        "audio_per_s": {"epd-1enc": {"encoder0": 12.0}, "epd-2enc": {"encoder0": 120 / 11, "encoder1": 12.0}},
        "workload": {"name": "audio120", "title": "one new 120 s clip at a time"},
        "commands": {"warm-up": {"epd-1enc": "epd-bench --seed 16"}, "audio120": {"epd-1enc": "epd-bench --seed 117"}},
    }
    return s | overrides


def test_target_is_the_two_encoder_ttft_over_the_one_encoder_ttft() -> None:
    (t,) = audio_report.targets(summary())
    assert t.value == pytest.approx(7100.0 / 12200.0) and t.met and t.limit == 0.65 and t.op == "<="
    text = audio_report.targets_text(summary())
    assert "one new 120 s clip: mean TTFT, epd-2enc ÷ epd-1enc" in text
    assert "epd-2enc: seconds of audio encoded per second, per encoder: encoder0 10.9, encoder1 12.0" in text
    s = summary()
    s["results"]["epd-2enc"] = merge_rounds([{"error": "boom"}])
    (missing,) = audio_report.targets(s)
    assert missing.value is None and missing.verdict() == "not measured"


def test_docs_section_goes_after_the_video_section_then_is_replaced_in_place(tmp_path: Path) -> None:
    docs = tmp_path / "BENCHMARKS.md"
    video = "<!-- video-bench:begin -->\nvideo\n<!-- video-bench:end -->"
    docs.write_text(f"# B\n\n{video}\n\n## Hand-written\n")
    audio_report.write_docs(summary(), docs)
    text = docs.read_text()
    assert text.index(video) < text.index(audio_report.BEGIN) < text.index(audio_report.END) < \
        text.index("## Hand-written")
    assert "| one new 120 s clip: mean TTFT, epd-2enc ÷ epd-1enc | 0.582 | <= 0.65 | met |" in text
    assert "| epd-2enc | encoder1 | 120.0 | 10.00 | 12.0 |" in text and "| epd-1enc | 2 / 0 | 12,200.0 |" in text
    assert "(2 s), each encoded on its own" in text and "60 windows, 3000 LM tokens" in text and "4 chunks" in text
    assert "`epd_encoder_run_seconds`" in text and "epd-bench --seed 117" in text
    audio_report.write_docs(summary(date="2026-12-04 10:00", busy_from=["call wall times"]), docs)
    again = docs.read_text()
    assert again.count(audio_report.BEGIN) == 1 and "2026-12-04 10:00" in again and "2026-12-03 09:00" not in again
    assert "worked out from `epd_encoder_encode_seconds`" in again and again.endswith("## Hand-written\n")


def test_failures_are_shown_with_their_first_error(tmp_path: Path) -> None:
    s = summary(warm_up_errors={"epd-2enc": "epd-bench exited 1"}, skipped={})
    s["results"]["epd-2enc"] = merge_rounds([_result(0.0, ok=False)])
    docs = tmp_path / "B.md"
    docs.write_text("# B\n")
    audio_report.write_docs(s, docs)
    text = docs.read_text()
    assert "**epd-2enc: warm-up failed** — epd-bench exited 1" in text
    assert "**epd-2enc: 1 failed** — first error: HTTP 400: audio_not_supported" in text
    assert "| epd-2enc | 0 / 1 |" in text and text.rstrip().endswith(audio_report.END)


def test_the_bench_audio_preset_builds_an_omni_thinker_that_model_info_reads(tmp_path: Path) -> None:
    from dataclasses import replace

    from epd_builders.bench_model import BENCH_AUDIO_SPEC, PRESETS, build_bench

    assert PRESETS[audio_compare.BUILD_PRESET] is BENCH_AUDIO_SPEC
    tiny = BENCH_AUDIO_SPEC.tiny_spec()
    assert (tiny.family, tiny.audio_hidden, tiny.audio_layers, tiny.audio_heads) == ("qwen2_5_omni", 768, 12, 12)
    narrow = replace(BENCH_AUDIO_SPEC, audio_hidden=32, audio_layers=1, audio_heads=2, text_hidden=32, text_layers=1)
    info = model_info(build_bench(narrow, tmp_path / "m"))
    assert info["family"] == "qwen2_5_omni_thinker" and (info["audio_layers"], info["audio_width"]) == (1, 32)
    assert info["window_frames"] == 200 and info["audio_params"] > 128 * 32 * 3 and info["lm_params"] > 0
