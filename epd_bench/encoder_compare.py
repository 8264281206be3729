"""Runs a 2-encoder ÷ 1-encoder comparison (video, audio): one new item per request, TTFT and each encoder's rate.

Systems (epd_bench/stacks.py): EPD with 1 encoder and EPD with 2 encoders, one decoder each; under "split" pinning
each encoder has one core of its own where the machine has them and runs one torch thread, so the 2-encoder system
puts two cores to work on one item where the 1-encoder system has one; the proxy cuts the item into chunks, which
the scheduler spreads over the encoders. Both answer one warm-up request, then the rounds alternate their order:
round r sends each system one request carrying a new item (seed + 100 r), the same to both, so nothing is cached.

Each encoder's rate comes from its /metrics around every measured request: the item's units (frames, seconds of
audio) times its share of the chunks encoded for that request, over the time it worked: its run seconds where it
reports them, else worked out from its calls' wall times (busy_seconds). Target: mean TTFT, 2 ÷ 1 encoders <= 0.65.
"""
from __future__ import annotations

import argparse
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from epd_bench.loads import Workload, epd_bench_cmd, metric_sum, run_one, run_rounds
from epd_bench.report import (
    DOCS,
    ROOT,
    Target,
    commands_block,
    finish,
    fmt,
    format_targets,
    left_out,
    metric,
    ratio,
    section,
    target_rows,
    write_section,
)
from epd_bench.stacks import Running, RunStart, SystemSpec, epd, rebuilt, started

SYSTEMS = {"epd-1enc": 1, "epd-2enc": 2}
ONE, TWO = SYSTEMS
DECODER_FLAGS = ("--max-num-seqs", "4")  # one request at a time: a few KV slots keep the decoder small
WARM_UP_SEED = 16  # its item is never a measured one (measured rounds use the workload seed + 100 r)
RUN_SECONDS = "epd_encoder_run_seconds_total"  # time the encode thread ran calls, queueing excluded (if exposed)


@dataclass(frozen=True)
class Case:
    """What one comparison sends: its workload, the units of one item, how the proxy chunks it, the docs' words."""

    kind: str  # "video", "audio": python -m epd_bench.<kind>_compare, make bench-<kind>, docs section <kind>-bench
    item: str  # what one request carries, for the target: "one new 32-frame video"
    model: str  # the preset built by default
    workload: Workload
    units: float  # of one item: a video's frames, a clip's seconds
    unit: str  # "frames", "audio seconds"
    proxy_flags: tuple[str, ...]
    title: str
    after: str  # the docs section a first run goes after
    model_info: Callable[[Path], dict[str, Any]]
    intro: Callable[[dict[str, Any]], str]

    @property
    def name(self) -> str:
        return f"{self.kind}-bench"


class Counters(NamedTuple):
    """An encoder's /metrics figures this comparison reads (cumulative)."""

    items: float  # epd_encoder_items_encoded_total: chunks (and images) run through the vision tower
    call_seconds: float  # epd_encoder_encode_seconds_sum: wall time of the /encode calls, waiting included
    calls: float  # epd_encoder_encode_seconds_count
    run_seconds: float | None  # RUN_SECONDS; None when the encoder does not expose it


def counters(text: str) -> Counters:
    return Counters(metric_sum(text, "epd_encoder_items_encoded_total") or 0.0,
                    metric_sum(text, "epd_encoder_encode_seconds_sum") or 0.0,
                    metric_sum(text, "epd_encoder_encode_seconds_count") or 0.0, metric_sum(text, RUN_SECONDS))


def encoder_counters(spec: SystemSpec) -> dict[str, Counters]:
    """encoder name -> its Counters now."""
    return {p.name: counters(httpx.get(f"{p.url}/metrics", timeout=30.0).text)
            for p in spec.procs if p.name.startswith("encoder")}


def busy_seconds(before: Counters, after: Counters) -> float:
    """How long the encoder worked for one request: its run seconds where it reports them; else from its calls'
    wall times. It runs one call at a time and gets an item's k chunks at once, one call each, so the calls last
    d, 2d, ..., kd: their sum is d k (k + 1) / 2 and it worked k d = 2 sum / (k + 1)."""
    if before.run_seconds is not None and after.run_seconds is not None:
        return after.run_seconds - before.run_seconds
    k = after.calls - before.calls
    return 2 * (after.call_seconds - before.call_seconds) / (k + 1) if k > 0 else 0.0


def encoder_work(before: dict[str, Counters], after: dict[str, Counters], units: float) -> dict[str, dict[str, float]]:
    """Per encoder, what one request made it do: {"units", "seconds"}; the item's units shared out by the chunks each
    encoder encoded (empty when no chunk was encoded)."""
    items = {name: after[name].items - before[name].items for name in after}
    if (total := sum(items.values())) <= 0:
        return {}
    return {name: {"units": units * items[name] / total, "seconds": busy_seconds(before[name], after[name])}
            for name in after}


def rates(work: dict[str, dict[str, float]]) -> dict[str, float | None]:
    return {name: w["units"] / w["seconds"] if w["seconds"] > 0 else None for name, w in work.items()}


def build_systems(case: Case, model_dir: Path, cores: int, pin: bool) -> list[SystemSpec]:
    return [epd(model_dir, n, cores, pin, decoder_flags=DECODER_FLAGS, name=name, proxy_flags=case.proxy_flags)
            for name, n in SYSTEMS.items()]


def measure(case: Case, up: list[Running], rounds: int, run_dir: Path) -> dict[str, Any]:
    """A warm-up request per system, then the rounds: results pooled, each encoder's work summed over the rounds
    that succeeded."""
    w, warm = case.workload, {}
    commands: dict[str, dict[str, str]] = {"warm-up": {}}
    for r in up:
        print(f"[{time.strftime('%H:%M:%S')}] warm-up on {r.spec.name}", flush=True)
        cmd = epd_bench_cmd(r.spec, w, 1, WARM_UP_SEED, run_dir / "results", f"warm-up-{r.spec.name}.json")
        commands["warm-up"][r.spec.name] = shlex.join(cmd)
        if error := run_one(cmd, run_dir / "epd-bench.log").get("error"):
            warm[r.spec.name] = error
    work: dict[str, dict[str, dict[str, float]]] = {r.spec.name: {} for r in up}
    busy_from: set[str] = set()

    def after(spec: SystemSpec, before: dict[str, Counters], result: dict[str, Any]) -> None:
        if all(result.get("successes") or [False]):
            now = encoder_counters(spec)
            for name, add in encoder_work(before, now, case.units).items():
                acc = work[spec.name].setdefault(name, {"units": 0.0, "seconds": 0.0})
                acc["units"], acc["seconds"] = acc["units"] + add["units"], acc["seconds"] + add["seconds"]
            busy_from.update("run seconds" if c.run_seconds is not None else "call wall times" for c in now.values())

    results, commands[w.name] = run_rounds(w, up, rounds, run_dir, lambda _: 1, encoder_counters, after,
                                           prefix=case.kind)
    return {"results": results, "encoder_work": work, "rates": {n: rates(x) for n, x in work.items()},
            "busy_from": sorted(busy_from), "warm_up_errors": warm, "commands": commands}


def targets(case: Case, s: dict[str, Any]) -> list[Target]:
    return [Target(f"{case.kind}_ttft_2enc_vs_1enc", f"{case.item}: mean TTFT, {TWO} ÷ {ONE}", ratio(metric(s, TWO, "mean_ttft_ms"), metric(s, ONE, "mean_ttft_ms")),
                   0.65, "<=")]


def tables(case: Case, s: dict[str, Any]) -> list[str]:
    lines = ["| system | ok / failed | mean TTFT ms | median TTFT ms | min TTFT ms | max TTFT ms | mean end-to-end ms "
             "| mean prompt tokens |", "|---|---|" + "---:|" * 6]
    for system, r in s["results"].items():
        if not r.get("completed"):
            lines.append(f"| {system} | 0 / {r.get('failed', '?')} |" + " – |" * 6)
            continue
        ok = [t * 1000.0 for t, good in zip(r["ttfts"], r["successes"], strict=True) if good]
        prompts = [n for n, good in zip(r["input_lens"], r["successes"], strict=True) if good]
        lines.append(f"| {system} | {r['completed']} / {r['failed']} | {fmt(r['mean_ttft_ms'])} | "
                     f"{fmt(r['median_ttft_ms'])} | {fmt(min(ok))} | {fmt(max(ok))} | {fmt(r['mean_e2el_ms'])} | "
                     f"{fmt(sum(prompts) / len(prompts), 0)} |")
    busy = ("`epd_encoder_run_seconds`: the time its encode thread ran, waiting excluded"
            if s.get("busy_from") == ["run seconds"] else "worked out from `epd_encoder_encode_seconds`: calls sent "
            "at once last d, 2d, ..., kd, so it worked 2 x their sum / (k + 1)")
    lines += ["", f"### {case.unit.capitalize()} encoded per second, per encoder", "",
              f"Each encoder's {case.unit} (the item's, shared out by the chunks it encoded) over the time it worked on "
              f"them, summed over the measured rounds, from its /metrics ({busy}).", "",
              f"| system | encoder | {case.unit} encoded | seconds working | {case.unit} per second |",
              "|---|---|---:|---:|---:|"]
    for system, per_encoder in s["encoder_work"].items():
        for name, w in sorted(per_encoder.items()):
            lines.append(f"| {system} | {name} | {fmt(w['units'], 1)} | {fmt(w['seconds'], 2)} | "
                         f"{fmt(s['rates'].get(system, {}).get(name), 1)} |")
    return lines


def render(case: Case, s: dict[str, Any]) -> str:
    body = [*target_rows(targets(case, s), title="### Target"), *left_out(s),
            f"### Workload `{case.workload.name}`: {case.workload.title}", "", *tables(case, s), "",
            *commands_block(s)]
    return section(case.name, case.title, f"make bench-{case.kind}    # = .venv/bin/python -m epd_bench."
                   f"{case.kind}_compare", s, case.intro(s), body)


def parse_args(case: Case, argv: list[str] | None, doc: str | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(f"python -m epd_bench.{case.kind}_compare", description=doc,
                                allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=case.model, help=f"'{case.model}' (built once, cached) or a checkpoint dir")
    p.add_argument("--pinning", choices=["split", "none"], default="split", help="see epd_bench/stacks.py")
    p.add_argument("--rounds", type=int, default=6, help="measured requests per system, alternating the order")
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / f"bench-{case.kind}")
    p.add_argument("--docs", type=Path, default=DOCS)
    p.add_argument("--no-docs", action="store_true", help="print the target, leave the docs alone")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def main(case: Case, argv: list[str] | None, doc: str | None) -> None:
    args = parse_args(case, argv, doc)
    run = RunStart.of(args)
    cores = len(os.sched_getaffinity(0))
    specs = build_systems(case, run.model_dir, cores, run.pin)
    with started(rebuilt(specs, lambda: build_systems(case, run.model_dir, cores, run.pin)),
                 run.run_dir / "logs") as (up, skipped):
        measured = measure(case, up, args.rounds, run.run_dir)
    s = run.summary(args.model, specs, skipped, model_info=case.model_info(run.model_dir), rounds=args.rounds,
                    workload={"name": case.workload.name, "title": case.workload.title}, **measured)
    text = "\n".join([format_targets(targets(case, s)), *(
        f"{system}: {case.unit} encoded per second, per encoder: "
        + (", ".join(f"{n} {fmt(x, 1)}" for n, x in sorted(per.items())) or "–") for system, per in s["rates"].items())])
    finish(s, run.run_dir, targets(case, s), text, None if args.no_docs else
           lambda: write_section(args.docs, case.name, render(case, s), case.after), f"{args.docs} ({case.name})")
