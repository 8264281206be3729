"""The vLLM comparison's medians, ratios and targets, and its generated section of docs/BENCHMARKS.md.

Issue 31's targets, from one `python -m epd_bench.vllm_compare` run (the same LM weights and load on both):
output tokens/s, EPD ÷ vLLM, >= 1.0 at 4 and at 16 in flight; mean time per output token, EPD ÷ vLLM, <= 1.0 at
every level. Each figure is the median over rounds of one run's value (a run: one level's requests on one system).
Only the text between BEGIN and END is replaced; with no markers yet the section goes after the video section.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from epd_bench.report import ROOT, Target, format_targets, write_section
from epd_bench.report import fmt as _f

BEGIN, END = "<!-- vllm-bench:begin -->", "<!-- vllm-bench:end -->"
AFTER = "<!-- video-bench:end -->"  # where a first run puts the section
EPD, VLLM = "epd", "vllm"
METRICS = ("output_tok_s", "mean_tpot_ms", "mean_ttft_ms")
THROUGHPUT_LEVELS = ("4", "16")  # the throughput target; TPOT is held to it at every level


def medians(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """level -> system -> metric -> the median over rounds (None when any round of that run had a failure or the
    system has no rounds: a partial run is not a measurement)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for level, systems in results.items():
        out[level] = {}
        for system, runs in systems.items():
            whole = bool(runs) and all(r["failed"] == 0 and r[METRICS[0]] is not None for r in runs)
            out[level][system] = {m: statistics.median(float(r[m]) for r in runs) if whole else None
                                  for m in METRICS}
    return out


def ratio(meds: dict[str, dict[str, dict[str, float | None]]], level: str, metric: str) -> float | None:
    """EPD ÷ vLLM of one metric's medians at one level (None when either is missing)."""
    a = meds.get(level, {}).get(EPD, {}).get(metric)
    b = meds.get(level, {}).get(VLLM, {}).get(metric)
    return None if a is None or b is None or b == 0 else a / b


def targets(summary: dict[str, Any]) -> list[Target]:
    meds = summary["medians"]
    out = [Target(f"vllm_throughput_{c}", f"{c} in flight: output tokens/s, EPD ÷ vLLM", ratio(meds, c, METRICS[0]),
                  1.0, ">=") for c in THROUGHPUT_LEVELS if c in meds]
    out += [Target(f"vllm_tpot_{c}", f"{c} in flight: mean TPOT, EPD ÷ vLLM", ratio(meds, c, METRICS[1]), 1.0, "<=")
            for c in meds]
    return out


def targets_text(summary: dict[str, Any]) -> str:
    return format_targets(targets(summary), 44)


def ratio_table(summary: dict[str, Any]) -> list[str]:
    meds = summary["medians"]
    lines = ["| in flight | EPD tok/s | vLLM tok/s | EPD ÷ vLLM tok/s | EPD TPOT ms | vLLM TPOT ms | EPD ÷ vLLM TPOT "
             "| EPD TTFT ms | vLLM TTFT ms | EPD ÷ vLLM TTFT |", "|---:|" + "---:|" * 9]
    for level, systems in meds.items():
        e, v = systems.get(EPD, {}), systems.get(VLLM, {})
        cells = [f"{_f(e.get(m))} | {_f(v.get(m))} | {_f(ratio(meds, level, m), 2)}" for m in METRICS]
        lines.append(f"| {level} | {' | '.join(cells)} |")
    return lines


def rounds_table(summary: dict[str, Any]) -> list[str]:
    """Every run's output tokens/s, so the spread behind each median shows."""
    lines = ["| in flight | system | output tok/s per round | failed requests |", "|---:|---|---|---:|"]
    for level, systems in summary["results"].items():
        for system, runs in systems.items():
            lines.append(f"| {level} | {system} | {', '.join(_f(r['output_tok_s']) for r in runs)} | "
                         f"{sum(r['failed'] for r in runs)} |")
    return lines


def _skipped(summary: dict[str, Any]) -> list[str]:
    return [f"- **{name} left out**: {why[:600]}" for name, why in summary["skipped"].items()] + (
        [""] if summary["skipped"] else [])


def _commands(summary: dict[str, Any]) -> list[str]:
    lines = ["```bash", "# the systems (ports vary per run)"]
    for system, procs in summary["systems"].items():
        lines.append(f"# {system}")
        lines += [p["command"] + " &" for p in procs]
    lines.append("```")
    home, root = str(Path.home()), str(ROOT) + "/"
    return [line.replace(root, "").replace(home, "~") for line in lines]


def _greedy(summary: dict[str, Any]) -> str:
    same = (summary.get("greedy_check") or {}).get("same")
    if same is None:
        return "The greedy check needs both systems."
    return ("Greedy check: one prompt's first 32 tokens, as text, are " +
            ("the same from both servers." if same else "**different** between the servers (see summary.json)."))


def _revision(summary: dict[str, Any]) -> str:
    sha = summary.get("epd_revision")
    return f"; EPD's code from revision {sha[:12]} (`--epd-revision`), not the working tree" if sha else ""


def render_section(s: dict[str, Any]) -> str:
    lm = s["lm"]
    load, after = (", ".join(f"{x:.2f}" for x in s[k]) for k in ("load_before", "load_after"))
    lines = [
        BEGIN, "## Text decode against vLLM's CPU build, same LM weights", "",
        "```bash", f"{s['command']}    # `make bench` runs it with $(BENCH_VLLM_ARGS); vLLM from runs/vllm-venv",
        "```", "",
        f"_Generated on {s['date']} ({s['cores']} cores, load average {load} before the run and {after} after; "
        f"{s['wall_s']:.0f} s in all, {s['startup_s']:.0f} s of it start-up). Everything between the `vllm-bench` "
        "markers is rewritten on each run._", "",
        f"Model `{s['model']}` (`epd_builders/bench_model.py`): its language model, a Llama with hidden "
        f"{lm['hidden_size']}, {lm['num_hidden_layers']} layers, {lm['num_attention_heads']} heads / "
        f"{lm['num_key_value_heads']} K/V heads, MLP {lm['intermediate_size']}, vocabulary {lm['vocab_size']} "
        f"({lm['lm_params'] / 1e6:.1f}M parameters, fp32), is exported as a LlamaForCausalLM for vLLM "
        f"(`epd_bench/lm_export.py`: all {lm['tensors_identical']} tensors byte-identical, checked); EPD serves the "
        f"LLaVA (proxy, decoder, one idle encoder{_revision(s)}). Both: context "
        f"{s['context']}, at most {s['max_num_seqs']} sequences, {s['threads']} OMP threads"
        f"{', pinned to the same cores' if s['pinned'] else ''}. Load: `/v1/completions`, prompts of "
        f"{s['prompt_len']} random token ids (new ones every round and level, the same for both systems), "
        f"{s['output_len']} new tokens, `ignore_eos`, greedy; max(2, in flight) requests per level; "
        f"{s['rounds']} rounds alternate which system goes first. Medians over rounds; TPOT and TTFT are each run's "
        f"means. {_greedy(s)}", "",
        *_skipped(s),
        "### Targets (issue 31)", "", "| target | measured | limit | verdict |", "|---|---:|---:|---|",
        *(f"| {t.what} | {_f(t.value, 2)} | {t.op} {t.limit} | {t.verdict()} |" for t in targets(s)), "",
        "### Medians", "", *ratio_table(s), "",
        "### Every round", "", *rounds_table(s), "",
        "### Commands", "", *_commands(s), "", END,
    ]
    return "\n".join(lines)


def write_docs(summary: dict[str, Any], docs: Path) -> None:
    write_section(docs, render_section(summary), BEGIN, END, AFTER)
