"""Writes a comparison's results: its targets, summary.json, and its marked section of docs/BENCHMARKS.md.

A section lies between `<!-- NAME:begin -->` and `<!-- NAME:end -->`; only that text is replaced, the rest of the
file is hand-written and left alone. Every table a section shows is built here from the comparison's summary.
"""
from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # commands in the docs are shown relative to the checkout
DOCS = ROOT / "docs" / "BENCHMARKS.md"


@dataclass
class Target:
    name: str
    what: str
    value: float | None  # None: could not be measured (a system missing or failed)
    limit: float
    op: str  # "<=" or ">="

    @property
    def met(self) -> bool:
        if self.value is None:
            return False
        return self.value <= self.limit if self.op == "<=" else self.value >= self.limit

    def verdict(self) -> str:
        if self.value is None:
            return "not measured"
        return "met" if self.met else f"**missed by {abs(self.value - self.limit):.2f}**"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def metric(summary: dict[str, Any], system: str, key: str, workload: str | None = None) -> float | None:
    """A pooled result's figure (None when the system is missing, failed, or lacks it)."""
    results = summary["results"] if workload is None else summary["results"].get(workload, {})
    result = results.get(system)
    if not result or not result.get("completed") or result.get(key) is None:
        return None
    return float(result[key])


def format_targets(found: list[Target], width: int = 66) -> str:
    """The targets as a console table (what each comparison prints at its end)."""
    rows = [f"  {t.what:<{width}} {'-' if t.value is None else f'{t.value:.3f}':>8}  {t.op} {t.limit:<4} "
            f"{t.verdict().replace('*', '')}" for t in found]
    return "targets:\n" + "\n".join(rows)


def fmt(value: Any, digits: int = 1) -> str:
    """A number for a docs table ("–": not measured)."""
    return "–" if value is None else f"{value:,.{digits}f}"


WORKLOAD_COLUMNS = {"req/s": ("request_throughput", 2), "output tok/s": ("output_throughput", 1),
                    "mean TTFT": ("mean_ttft_ms", 1), "median TTFT": ("median_ttft_ms", 1),
                    "p90 TTFT": ("p90_ttft_ms", 1), "p99 TTFT": ("p99_ttft_ms", 1),
                    "median TPOT": ("median_tpot_ms", 1), "median ITL": ("median_itl_ms", 1),
                    "p99 ITL": ("p99_itl_ms", 1), "mean E2EL": ("mean_e2el_ms", 1)}


def workload_table(summary: dict[str, Any], workload: str | None,
                   columns: dict[str, tuple[str, int]] = WORKLOAD_COLUMNS) -> list[str]:
    """One row per system: ok / failed, then each column's figure from its pooled result."""
    results = summary["results"] if workload is None else summary["results"].get(workload, {})
    lines = ["| system | ok / failed | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
    for system, r in results.items():
        if not r.get("completed"):
            lines.append(f"| {system} | 0 / {r.get('failed', '?')} |" + " – |" * len(columns))
            continue
        cells = [f"{r['completed']} / {r['failed']}", *(fmt(r.get(k), d) for k, d in columns.values())]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return lines


def target_rows(found: list[Target], digits: int = 3, title: str = "### Targets") -> list[str]:
    return [title, "", "| target | measured | limit | verdict |", "|---|---:|---:|---|",
            *(f"| {t.what} | {fmt(t.value, digits)} | {t.op} {t.limit} | {t.verdict()} |" for t in found), ""]


def systems_table(summary: dict[str, Any]) -> list[str]:
    lines = ["| system | process | cores (taskset) | OMP threads |", "|---|---|---|---:|"]
    for system, procs in summary["systems"].items():
        for p in procs:
            cpus = ",".join(map(str, p["cpus"])) if p["cpus"] is not None else "any (not pinned)"
            lines.append(f"| {system} | {p['name']} | {cpus} | {p['threads'] or '–'} |")
    return lines


def commands_block(summary: dict[str, Any]) -> list[str]:
    """The systems' command lines, then each group of load commands (the last round's: rounds differ in --seed)."""
    lines = ["### Commands", "", "```bash", "# the systems (ports vary per run)"]
    for system, procs in summary["systems"].items():
        lines += [f"# {system}", *(p["command"] + " &" for p in procs)]
    for group, cmds in summary.get("commands", {}).items():
        lines.append(f"# {group}" + (" (last round shown; rounds differ only in --seed)" if group != "warm-up" else ""))
        lines += list(cmds.values()) if isinstance(cmds, dict) else [cmds]
    lines.append("```")
    home, root = str(Path.home()), str(ROOT) + "/"
    return [line.replace(root, "").replace(home, "~") for line in lines] + [""]


def left_out(summary: dict[str, Any]) -> list[str]:
    """Why a system is missing, whose warm-up failed, and each system's first error."""
    lines = []
    for name, why in summary["skipped"].items():
        lines += [f"**{name}: left out** — {why[:600]}", ""]
    for name, why in summary.get("warm_up_errors", {}).items():
        lines += [f"**{name}: warm-up failed** — {why}", ""]
    for name, r in summary["results"].items():
        if "completed" in r and (errors := [e for e in r.get("errors", []) if e]):
            lines += [f"**{name}: {len(errors)} failed** — first error: {errors[0][:300]}", ""]
    return lines


def section(name: str, title: str, make: str, s: dict[str, Any], intro: str, body: list[str]) -> str:
    """A whole marked section: title, the command that makes it, when and where it ran, the intro, the body."""
    load, after = (", ".join(f"{x:.2f}" for x in s[k]) for k in ("load_before", "load_after"))
    startup = f", {s['startup_s']:.0f} s of it starting the systems" if s.get("startup_s") else ""
    return "\n".join([
        f"<!-- {name}:begin -->", f"## {title}", "", "```bash", make, "```", "",
        f"_Generated on {s['date']} ({s['cores']} cores, load average {load} before the run and {after} after; "
        f"{s['wall_s']:.0f} s in all{startup}). Everything between the `{name}` markers is rewritten on each run._",
        "", intro, "", *body, f"<!-- {name}:end -->"])


def replace_section(text: str, section_text: str, begin: str, end: str) -> str:
    """Swap the section marked begin..end; with no markers yet, put it after the title and intro (before the first ##)."""
    if begin in text and end in text:
        return re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: section_text, text, count=1, flags=re.S)
    head, sep, rest = text.partition("\n## ")
    return f"{head.rstrip()}\n\n{section_text}\n\n## {rest}" if sep else f"{text.rstrip()}\n\n{section_text}\n"


def write_section(docs: Path, name: str, section_text: str, after: str | None = None) -> None:
    """Write the section named `name` into the docs file: in place of its marked one, else after the section named
    `after`, else after the intro."""
    text, begin, end = docs.read_text(), f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    mark = f"<!-- {after}:end -->" if after else None
    if not (begin in text and end in text) and mark and mark in text:
        docs.write_text(text.replace(mark, f"{mark}\n\n{section_text}", 1))
    else:
        docs.write_text(replace_section(text, section_text, begin, end))


def finish(summary: dict[str, Any], run_dir: Path, found: list[Target], text: str,
           write_docs: Callable[[], None] | None, written: str) -> None:
    """A comparison's end: its targets into the summary, summary.json into the run's dir, the targets printed, and
    the docs regenerated by `write_docs` (None: --no-docs; `written` says what it writes)."""
    summary["targets"] = [t.__dict__ | {"met": t.met} for t in found]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(text)
    if write_docs is not None:
        write_docs()
        print(f"regenerated {written}")
    print(f"results: {run_dir}; wall time {summary['wall_s']} s")


def param_counts(model_dir: Path, part: Callable[[str], str]) -> dict[str, int]:
    """Parameters per part of the checkpoint (part(tensor name) -> its part), from the safetensors header (no torch)."""
    with (model_dir / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    counts: dict[str, int] = {}
    for k, v in header.items():
        if k != "__metadata__":
            counts[part(k)] = counts.get(part(k), 0) + math.prod(v["shape"])
    return counts
