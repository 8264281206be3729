"""The audio comparison's target and its generated section of docs/BENCHMARKS.md.

Issue 35's target, from one `python -m epd_bench.audio_compare` run: mean TTFT of one request carrying a new 2-minute
clip, EPD with 2 encoders ÷ EPD with 1 encoder (<= 0.65, for a family whose encoder windows are independent). Beside
it, the seconds of audio each encoder encoded per second it worked. Only the text between BEGIN and END is
replaced; with no markers yet the section goes after the video section (else at the end). The TTFT table, the
error lines and the commands are the video report's (epd_bench/video_report.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from epd_bench.report import Target, format_targets, write_section
from epd_bench.report import fmt as _f
from epd_bench.video_report import _commands, _errors, encoder_ratio, target_rows, ttft_table

BEGIN, END = "<!-- audio-bench:begin -->", "<!-- audio-bench:end -->"
AFTER = "<!-- video-bench:end -->"  # where a first run puts the section


def targets(summary: dict[str, Any]) -> list[Target]:
    return [encoder_ratio("audio_ttft_2enc_vs_1enc", f"one new {summary['audio_seconds']} s clip", summary)]


def targets_text(summary: dict[str, Any]) -> str:
    lines = [format_targets(targets(summary))]
    for system, per_encoder in summary.get("audio_per_s", {}).items():
        rates = ", ".join(f"{name} {_f(rate, 1)}" for name, rate in sorted(per_encoder.items()))
        lines.append(f"{system}: seconds of audio encoded per second, per encoder: {rates or '–'}")
    return "\n".join(lines)


def encoder_table(summary: dict[str, Any]) -> list[str]:
    lines = ["| system | encoder | audio seconds encoded | seconds working | audio seconds per second |",
             "|---|---|---:|---:|---:|"]
    for system, per_encoder in summary["encoder_work"].items():
        rate = summary["audio_per_s"].get(system, {})
        for name, w in sorted(per_encoder.items()):
            lines.append(f"| {system} | {name} | {_f(w['audio_s'], 1)} | {_f(w['seconds'], 2)} | "
                         f"{_f(rate.get(name), 1)} |")
    return lines


def _busy_from(summary: dict[str, Any]) -> str:
    if summary.get("busy_from") == ["run seconds"]:
        return "`epd_encoder_run_seconds`: the time its encode thread ran, waiting excluded"
    return ("worked out from `epd_encoder_encode_seconds`: an encoder runs one call at a time and gets a clip's k "
            "chunks at once, one call each, so the calls last d, 2d, ..., kd and it worked 2 x their sum / (k + 1)")


def render_section(s: dict[str, Any]) -> str:
    m = s["model_info"]
    load, after = (", ".join(f"{x:.2f}" for x in s[k]) for k in ("load_before", "load_after"))
    window_s = m["window_frames"] / 100  # mel frames at 100 per second
    tokens = round(s["audio_seconds"] * 25)  # 25 LM tokens per second of audio
    chunks = -(-s["audio_seconds"] // s["chunk_seconds"])
    threads = sorted({p["threads"] for procs in s["systems"].values() for p in procs if p["name"].startswith("enc")})
    lines = [
        BEGIN, f"## Audio: one {s['audio_seconds']} s clip, EPD with 2 encoders and with 1", "",
        "```bash",
        "make bench-audio    # = .venv/bin/python -m epd_bench.audio_compare: builds bench-audio once, starts both "
        "systems, runs the rounds, rewrites this section",
        "```", "",
        f"_Generated on {s['date']} ({s['cores']} cores, load average {load} before the run and {after} after; "
        f"{s['wall_s']:.0f} s in all). Everything between the `audio-bench` markers is rewritten on each run._", "",
        f"Model `{s['model']}` (`epd_builders/bench_model.py`): a random {m['family']} whose audio tower has "
        f"{m['audio_layers']} layers of width {m['audio_width']} ({m['audio_heads']} heads, MLP {m['audio_ffn']}): "
        f"{m['audio_params'] / 1e6:.1f}M parameters, attending within windows of {m['window_frames']} mel frames "
        f"({window_s:g} s), each encoded on its own; its LM has hidden {m['lm_hidden']} and {m['lm_layers']} layers "
        f"({m['lm_params'] / 1e6:.1f}M with embeddings). A {s['audio_seconds']} s clip is "
        f"{s['audio_seconds'] / window_s:g} windows, {tokens} LM tokens. Systems: EPD with 1 and with 2 encoders, one "
        f"decoder each, pinning `{s['pinning']}` (epd_bench/stacks.py), each encoder on one core with "
        f"{', '.join(map(str, threads)) or '?'} torch thread(s); the proxy cuts a clip into chunks of "
        f"{s['chunk_seconds']} s of whole windows (`--audio-chunk-seconds`; {chunks} chunks), which the scheduler "
        f"spreads over the encoders. After one warm-up clip each, {s['rounds']} round{'s' if s['rounds'] != 1 else ''} "
        "alternate the order of the systems; each round sends both the same new clip (a 16 kHz mono WAV tone, a new "
        "one every round, so nothing is cached) in one request. The 2-encoder system needs as many free cores as it "
        "has encoders: other work on the machine slows it more than the 1-encoder system, and the ratio rises with "
        "the load.", "",
        *target_rows(targets(s)), *_errors(s),
        f"### Workload `{s['workload']['name']}`: {s['workload']['title']}", "", *ttft_table(s), "",
        "### Seconds of audio encoded per second, per encoder", "",
        "Each encoder's seconds of audio (the clip's, shared out by the chunks it encoded) over the time it worked on "
        "them (decoding the WAV, the mel features, the audio tower), summed over the measured rounds, from its "
        f"/metrics ({_busy_from(s)}).", "", *encoder_table(s), "",
        "### Commands", "", *_commands(s), "", END,
    ]
    return "\n".join(lines)


def write_docs(summary: dict[str, Any], docs: Path) -> None:
    write_section(docs, render_section(summary), BEGIN, END, AFTER)
