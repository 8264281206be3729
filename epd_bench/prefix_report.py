"""The prefix-cache comparison's targets and its generated section of docs/BENCHMARKS.md.

Issue 16's two targets, per mode (EPD, aggregated), from one `python -m epd_bench.prefix_compare` run:
mean TTFT of turns >= 2 of the multi-turn workload with the cache on / off (<= 0.3), and throughput of
the shared-system-prompt workload on / off (>= 1.5). A third line checks the premise: on `bench-lm` the
first turn's prefill must cost at least 5x a request's fixed overhead, or the cache has little to save.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from epd_bench.report import ROOT, Target, format_targets, replace_section
from epd_bench.report import fmt as _f

BEGIN, END = "<!-- prefix-bench:begin -->", "<!-- prefix-bench:end -->"
MODES = ("epd", "aggregated")
ON, OFF = "cache", "nocache"  # system names are f"{mode}-{ON}" and f"{mode}-{OFF}"


def system_name(mode: str, cache: bool) -> str:
    return f"{mode}-{ON if cache else OFF}"


def _get(summary: dict[str, Any], workload: str, system: str, key: str) -> float | None:
    result = summary["results"].get(workload, {}).get(system)
    if not result or not result.get("completed") or result.get(key) is None:
        return None
    return float(result[key])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def prefill_over_overhead(calibration: dict[str, Any] | None) -> float | None:
    """(first turn's TTFT with its image already encoded - a 1-word prompt's TTFT) / the 1-word prompt's TTFT."""
    if not calibration or not calibration.get("one_word_ms") or calibration.get("first_turn_ms") is None:
        return None
    return (float(calibration["first_turn_ms"]) - calibration["one_word_ms"]) / float(calibration["one_word_ms"])


def targets(summary: dict[str, Any]) -> list[Target]:
    out = []
    for mode in MODES:
        on, off = system_name(mode, True), system_name(mode, False)
        if on not in summary["systems"] and off not in summary["systems"]:
            continue
        out.append(Target(f"{mode}_multi_turn_ttft_turn2plus", f"{mode}: mean TTFT of turns ≥ 2, cache on ÷ off",
                          _ratio(_get(summary, "multi-turn", on, "mean_ttft_ms_turn2plus"),
                                 _get(summary, "multi-turn", off, "mean_ttft_ms_turn2plus")), 0.3, "<="))
        out.append(Target(f"{mode}_shared_prefix_throughput", f"{mode}: shared system prompt, requests/s, "
                          "cache on ÷ off", _ratio(_get(summary, "shared-prefix", on, "request_throughput"),
                                                    _get(summary, "shared-prefix", off, "request_throughput")),
                          1.5, ">="))
        out.append(Target(f"{mode}_prefill_vs_overhead", f"{mode}: first turn's prefill ÷ fixed per-request overhead",
                          prefill_over_overhead(summary.get("calibration", {}).get(off)), 5.0, ">="))
    return out


def targets_text(summary: dict[str, Any]) -> str:
    return format_targets(targets(summary))


def workload_table(summary: dict[str, Any], workload: str) -> list[str]:
    lines = ["| system | ok / failed | req/s | output tok/s | mean TTFT | mean TTFT turn 1 | mean TTFT turns ≥ 2 "
             "| mean prompt tokens turns ≥ 2 | mean cached tokens turns ≥ 2 | mean cached tokens | median ITL |",
             "|---|---|" + "---:|" * 9]
    for system, r in summary["results"].get(workload, {}).items():
        if not r.get("completed"):
            lines.append(f"| {system} | 0 / {r.get('failed', '?')} |" + " – |" * 9)
            continue
        cells = [f"{r['completed']} / {r['failed']}", _f(r["request_throughput"], 2), _f(r["output_throughput"]),
                 *(_f(r.get(k)) for k in ("mean_ttft_ms", "mean_ttft_ms_turn1", "mean_ttft_ms_turn2plus",
                                          "mean_prompt_tokens_turn2plus", "mean_cached_tokens_turn2plus",
                                          "mean_cached_tokens", "median_itl_ms"))]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return lines


def calibration_lines(summary: dict[str, Any]) -> list[str]:
    lines = ["| mode | 1-word prompt: median TTFT ms | first turn, image already encoded: median TTFT ms "
             "| its prompt tokens | prefill ÷ overhead |", "|---|---:|---:|---:|---:|"]
    for mode in MODES:
        c = summary.get("calibration", {}).get(system_name(mode, False))
        if c:
            lines.append(f"| {mode} | {_f(c['one_word_ms'])} | {_f(c['first_turn_ms'])} | {c['first_turn_tokens']} "
                         f"| {_f(prefill_over_overhead(c), 1)} |")
    return lines


def _commands(summary: dict[str, Any]) -> list[str]:
    lines = ["```bash", "# the systems (ports vary per run)"]
    for system, procs in summary["systems"].items():
        lines += [f"# {system}", *(p["command"] + " &" for p in procs)]
    for workload, cmds in summary["commands"].items():
        lines.append(f"# {workload} (last round or run shown; rounds differ only in --seed)")
        lines += list(cmds.values())
    lines.append("```")
    home, root = str(Path.home()), str(ROOT) + "/"
    return [line.replace(root, "").replace(home, "~") for line in lines]


def render_section(s: dict[str, Any]) -> str:
    lm = s["model_info"]
    load = ", ".join(f"{x:.2f}" for x in s["load_before"])
    lines = [
        BEGIN, "## Prefix cache: multi-turn and shared system prompt, cache on and off", "",
        "```bash",
        "make bench-prefix    # = .venv/bin/python -m epd_bench.prefix_compare: builds bench-lm once, starts the four "
        "systems, runs both workloads, rewrites this section",
        "```", "",
        f"_Generated on {s['date']} ({s['cores']} cores, load average {load} before the run; {s['wall_s']:.0f} s in "
        f"all). Everything between the `prefix-bench` markers is rewritten on each run._", "",
        f"Model `{s['model']}` (`epd_builders/bench_model.py`): the `bench` vision tower (ViT-B/16, 196 tokens per "
        f"image) and a random Llama LM with hidden {lm['hidden_size']}, {lm['num_hidden_layers']} layers, "
        f"{lm['num_attention_heads']} query and {lm['num_key_value_heads']} K/V heads, MLP {lm['intermediate_size']}: "
        f"{lm['lm_params'] / 1e6:.1f}M parameters. Systems: EPD (1 encoder, 1 decoder) and the aggregated decoder, "
        "each with the decoder's prefix cache on (its default) and off (`--prefix-cache-bytes 0`). Each workload runs "
        f"in {s['rounds']} round{'s' if s['rounds'] != 1 else ''} that alternate the order of the systems; each "
        "system's rounds are pooled. With the prefix cache off, cached tokens are still reported for images whose "
        "embeddings the decoder already held (196 per image).", "",
        "### Targets", "", "| target | measured | limit | verdict |", "|---|---:|---:|---|",
        *(f"| {t.what} | {_f(t.value, 3)} | {t.op} {t.limit} | {t.verdict()} |" for t in targets(s)), "",
        "### Fixed overhead and the first turn's prefill (cache off)", "",
        "The fixed per-request overhead is the median TTFT of a 1-word text prompt through the proxy; the first "
        "turn's cost, the median TTFT of a first-turn-shaped prompt (the multi-turn system prompt, one image, one "
        "question) whose image was already encoded, so it times prefill, not the vision tower.", "",
        *calibration_lines(s), "",
    ]
    for name, why in s["skipped"].items():
        lines += [f"**{name}: left out** — {why}", ""]
    for workload, info in s["workloads"].items():
        lines += [f"### Workload `{workload}`: {info['title']}", "", *workload_table(s, workload), ""]
    lines += ["### Commands", "", *_commands(s), "", END]
    return "\n".join(lines)


def write_docs(summary: dict[str, Any], docs: Path) -> None:
    docs.write_text(replace_section(docs.read_text(), render_section(summary), BEGIN, END))
