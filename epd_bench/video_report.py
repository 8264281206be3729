"""The video comparison's target and its generated section of docs/BENCHMARKS.md.

Issue 17's target, from one `python -m epd_bench.video_compare` run: mean TTFT of one request carrying a new
32-frame video, EPD with 2 encoders ÷ EPD with 1 encoder (<= 0.65). Beside it, the frames per second each encoder
encoded. Only the text between BEGIN and END is replaced; with no markers yet the section goes after the
prefix-cache section (else at the end).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from epd_bench.report import ROOT, Target, format_targets, write_section
from epd_bench.report import fmt as _f

BEGIN, END = "<!-- video-bench:begin -->", "<!-- video-bench:end -->"
AFTER = "<!-- prefix-bench:end -->"  # where a first run puts the section
ONE, TWO = "epd-1enc", "epd-2enc"


def _ttft(summary: dict[str, Any], system: str) -> float | None:
    result = summary["results"].get(system)
    if not result or not result.get("completed") or result.get("mean_ttft_ms") is None:
        return None
    return float(result["mean_ttft_ms"])


def targets(summary: dict[str, Any]) -> list[Target]:
    return [encoder_ratio("video_ttft_2enc_vs_1enc", f"one new {summary['frames']}-frame video", summary)]


def target_rows(found: list[Target]) -> list[str]:
    """The section's "Target" table."""
    return ["### Target", "", "| target | measured | limit | verdict |", "|---|---:|---:|---|",
            *(f"| {t.what} | {_f(t.value, 3)} | {t.op} {t.limit} | {t.verdict()} |" for t in found), ""]


def encoder_ratio(name: str, what: str, summary: dict[str, Any]) -> Target:
    """The target of a 2-encoder ÷ 1-encoder comparison: mean TTFT of `what`, at most 0.65."""
    one, two = _ttft(summary, ONE), _ttft(summary, TWO)
    ratio = None if one is None or two is None or one == 0 else two / one
    return Target(name, f"{what}: mean TTFT, {TWO} ÷ {ONE}", ratio, 0.65, "<=")


def targets_text(summary: dict[str, Any]) -> str:
    return format_targets(targets(summary))


def ttft_table(summary: dict[str, Any]) -> list[str]:
    lines = ["| system | ok / failed | mean TTFT ms | median TTFT ms | min TTFT ms | max TTFT ms | mean end-to-end ms "
             "| mean prompt tokens |", "|---|---|" + "---:|" * 6]
    for system, r in summary["results"].items():
        if not r.get("completed"):
            lines.append(f"| {system} | 0 / {r.get('failed', '?')} |" + " – |" * 6)
            continue
        ok = [t * 1000.0 for t, good in zip(r["ttfts"], r["successes"], strict=True) if good]
        prompts = [n for n, good in zip(r["input_lens"], r["successes"], strict=True) if good]
        cells = [f"{r['completed']} / {r['failed']}", _f(r["mean_ttft_ms"]), _f(r["median_ttft_ms"]), _f(min(ok)),
                 _f(max(ok)), _f(r["mean_e2el_ms"]), _f(sum(prompts) / len(prompts), 0)]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return lines


def encoder_table(summary: dict[str, Any]) -> list[str]:
    lines = ["| system | encoder | frames encoded | seconds working | frames/s |", "|---|---|---:|---:|---:|"]
    for system, per_encoder in summary["encoder_work"].items():
        fps = summary["frames_per_s"].get(system, {})
        for name, w in sorted(per_encoder.items()):
            lines.append(f"| {system} | {name} | {_f(w['frames'], 0)} | {_f(w['seconds'], 2)} | "
                         f"{_f(fps.get(name), 1)} |")
    return lines


def _busy_from(summary: dict[str, Any]) -> str:
    if summary.get("busy_from") == ["run seconds"]:
        return "`epd_encoder_run_seconds`: the time its encode thread ran, waiting excluded"
    return ("worked out from `epd_encoder_encode_seconds`: an encoder runs one call at a time and gets a video's k "
            "chunks at once, one call each, so the calls last d, 2d, ..., kd and it worked 2 x their sum / (k + 1)")


def _errors(summary: dict[str, Any]) -> list[str]:
    lines = []
    for name, why in summary["skipped"].items():
        lines += [f"**{name}: left out** — {why}", ""]
    for name, why in summary.get("warm_up_errors", {}).items():
        lines += [f"**{name}: warm-up failed** — {why}", ""]
    for name, r in summary["results"].items():
        if errors := [e for e in r.get("errors", []) if e]:
            lines += [f"**{name}: {len(errors)} failed** — first error: {errors[0][:300]}", ""]
    return lines


def _commands(summary: dict[str, Any]) -> list[str]:
    lines = ["```bash", "# the systems (ports vary per run)"]
    for system, procs in summary["systems"].items():
        lines += [f"# {system}", *(p["command"] + " &" for p in procs)]
    for what, cmds in summary["commands"].items():
        lines.append(f"# {what}" + (" (last round shown; rounds differ only in --seed)" if what != "warm-up" else ""))
        lines += list(cmds.values())
    lines.append("```")
    home, root = str(Path.home()), str(ROOT) + "/"
    return [line.replace(root, "").replace(home, "~") for line in lines]


def render_section(s: dict[str, Any]) -> str:
    m = s["model_info"]
    load, after = (", ".join(f"{x:.2f}" for x in s[k]) for k in ("load_before", "load_after"))
    size, side, temporal = s["frame_size"], s["frame_size"] // m["patch_size"], s["frames"] // m["temporal_patch_size"]
    threads = sorted({p["threads"] for procs in s["systems"].values() for p in procs if p["name"].startswith("enc")})
    lines = [
        BEGIN, f"## Video: one {s['frames']}-frame video, EPD with 2 encoders and with 1", "",
        "```bash",
        "make bench-video    # = .venv/bin/python -m epd_bench.video_compare: builds bench-video once, starts both "
        "systems, runs the rounds, rewrites this section",
        "```", "",
        f"_Generated on {s['date']} ({s['cores']} cores, load average {load} before the run and {after} after; "
        f"{s['wall_s']:.0f} s in all). Everything between the `video-bench` markers is rewritten on each run._", "",
        f"Model `{s['model']}` (`epd_builders/bench_model.py`): a random {m['family']} whose vision tower has "
        f"{m['vision_depth']} blocks of width {m['vision_width']} (MLP {m['vision_mlp_ratio']}x), patch "
        f"{m['patch_size']}, {m['temporal_patch_size']} frames per temporal patch: {m['vision_params'] / 1e6:.1f}M "
        f"parameters; its LM has hidden {m['lm_hidden']} and {m['lm_layers']} layers ({m['lm_params'] / 1e6:.1f}M "
        f"with embeddings). A {size}x{size} frame is {side}x{side} patches; {s['frames']} frames are {temporal} "
        f"temporal patches, {temporal * side * side // m['merge_size'] ** 2} LM tokens. Systems: EPD with 1 and with 2 encoders, one decoder each, pinning `{s['pinning']}` "
        f"(epd_bench/stacks.py), each encoder on one core with {', '.join(map(str, threads)) or '?'} torch "
        f"thread(s); the proxy cuts a video into chunks of {s['chunk_frames']} sampled frames. After one warm-up "
        f"video each, {s['rounds']} round{'s' if s['rounds'] != 1 else ''} alternate the order of the systems; each "
        "round sends both the same new clip (a new one every round, so nothing is cached) in one request. The "
        "2-encoder system needs as many free cores as it has encoders: other work on the machine slows it more than "
        "the 1-encoder system, and the ratio rises with the load.", "",
        *target_rows(targets(s)), *_errors(s),
        f"### Workload `{s['workload']['name']}`: {s['workload']['title']}", "", *ttft_table(s), "",
        "### Frames encoded per second, per encoder", "",
        "Each encoder's frames (the video's, shared out by the chunks it encoded) over the time it worked on them "
        "(decoding the frames, preprocessing, the vision tower), summed over the measured rounds, from its /metrics "
        f"({_busy_from(s)}).", "", *encoder_table(s), "",
        "### Commands", "", *_commands(s), "", END,
    ]
    return "\n".join(lines)


def write_docs(summary: dict[str, Any], docs: Path) -> None:
    write_section(docs, render_section(summary), BEGIN, END, AFTER)
