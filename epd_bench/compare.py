"""The side-by-side comparison behind `make bench`: the same model and workloads against every system, one run.

    python -m epd_bench.compare [--scale 1.0] [--pinning split|overlap|none] [--no-docs]
    python -m epd_bench.compare --systems epd-1enc --workloads repeat50 --overhead-rounds 0 --no-docs \
        --baseline-decoder-flags "--max-prefill-tokens 32"    # each system beside itself with other decoder flags

Systems (epd_bench/stacks.py; started together, then measured one after another, workload by workload, so
machine noise hits them alike): the aggregated baseline (one decoder that encodes and decodes),
`transformers serve` with the same checkpoint (from its own venv, when installed), and EPD with 1 and 2
encoders. Workloads are epd-bench runs (each command is kept and printed in the docs). Results go to
runs/bench/<time>/; the targets are printed, and docs/BENCHMARKS.md's marked section and docs/bench/*.png
are regenerated.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
from pathlib import Path
from typing import Any

from epd_bench.loads import Workload, epd_bench_cmd, num_prompts, run_epd_bench, run_rounds
from epd_bench.report import (
    DOCS,
    ROOT,
    Target,
    commands_block,
    finish,
    format_targets,
    left_out,
    metric,
    ratio,
    section,
    systems_table,
    target_rows,
    workload_table,
)
from epd_bench.stacks import Running, RunStart, SystemSpec, aggregated, epd, rebuilt, started, transformers_serve

NAME = "epd-bench"  # the docs section's markers
DEFAULT_TSERVE = ROOT / "runs" / "tserve-venv" / "bin" / "transformers"
SYSTEMS = ("aggregated", "transformers-serve", "epd-1enc", "epd-2enc")
EPD_SYSTEMS = ("epd-1enc", "epd-2enc")
_TEXT = ("--random-input-len", "32")
WORKLOADS = (
    # 2 requests/s is near what these systems sustain here (about 2.2/s), where encodes queue; at 1/s a new image's
    # TTFT is mostly one encode. transformers serve runs VLM requests one at a time: slow_prompts caps its share.
    Workload("repeat50", "1 image per request, 50 % of images repeated, Poisson arrivals at 2 requests/s",
             ("--images-per-request", "1", "--repeat-ratio", "0.5", "--request-rate", "2", *_TEXT,
              "--random-output-len", "32", "--num-warmups", "2"), 40, 1, 6),
    Workload("repeat50-light", "as `repeat50`, at 1 request/s",
             ("--images-per-request", "1", "--repeat-ratio", "0.5", "--request-rate", "1", *_TEXT,
              "--random-output-len", "32", "--num-warmups", "2"), 24, 5, 4),
    Workload("images4", "4 new images per request, one request at a time",
             ("--images-per-request", "4", "--max-concurrency", "1", *_TEXT, "--random-output-len", "16",
              "--num-warmups", "1"), 8, 2, 2),
    Workload("text", "text only, 16 requests in flight",
             ("--images-per-request", "0", "--max-concurrency", "16", *_TEXT, "--random-output-len", "64",
              "--num-warmups", "2"), 64, 3, 8),
)
OVERHEAD = Workload("overhead", "text only, one request at a time, 16 output tokens: proxy vs straight to the decoder",
                    ("--images-per-request", "0", "--max-concurrency", "1", *_TEXT, "--random-output-len", "16",
                     "--num-warmups", "3"), 64, 4)


def build_systems(args: argparse.Namespace, model_dir: Path, pin: bool) -> tuple[list[SystemSpec], dict[str, str]]:
    """The systems asked for, and why any of them is left out."""
    cores, specs, skipped = len(os.sched_getaffinity(0)), [], {}
    # each of ours, and again as `<name>-base` with --baseline-decoder-flags when given
    variants = [((), "")] + ([(tuple(args.baseline_decoder_flags), "-base")] if args.baseline_decoder_flags else [])
    for name in args.systems:
        if name == "aggregated":
            specs += [aggregated(model_dir, cores, pin, flags, name + suffix) for flags, suffix in variants]
        elif name.startswith("epd-"):
            specs += [epd(model_dir, int(name[4:-3]), cores, pin, args.pinning == "overlap", flags, name + suffix)
                      for flags, suffix in variants]
        elif not args.transformers_serve.exists():
            skipped[name] = (f"not installed: {args.transformers_serve} is missing (`make bench` installs it into "
                             "runs/tserve-venv; see runs/tserve-install.log)")
        else:
            eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
            specs.append(transformers_serve(args.transformers_serve, model_dir, int(eos), cores, pin))
    return specs, skipped


def measure_overhead(system: SystemSpec, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Rounds alternating proxy and direct-to-decoder epd-bench runs (same prompts); TTFT samples pooled per path."""
    ttfts: dict[str, list[float]] = {"proxy": [], "decoder": []}
    cmds: dict[str, str] = {}
    paired: list[float] = []  # proxy - decoder TTFT of the same prompt (a round sends both paths the same ones)
    n = num_prompts(system, OVERHEAD, args.scale, args.overhead_rounds)
    for rnd in range(args.overhead_rounds):
        got: dict[str, list[float | None]] = {}
        for path in ("proxy", "decoder") if rnd % 2 == 0 else ("decoder", "proxy"):
            cmd = epd_bench_cmd(system, OVERHEAD, n, OVERHEAD.seed + 100 * rnd, run_dir / "results",
                                f"overhead-{path}-{rnd}.json", direct=path == "decoder")
            result = run_epd_bench(cmd, run_dir / "epd-bench.log")
            got[path] = [t if ok else None for t, ok in zip(result["ttfts"], result["successes"], strict=True)]
            ttfts[path] += [t for t in got[path] if t is not None]
            cmds[path] = shlex.join(cmd)
        paired += [a - b for a, b in zip(got["proxy"], got["decoder"], strict=True) if a is not None and b is not None]
    med = {p: statistics.median(v) * 1000.0 for p, v in ttfts.items()}
    return {"system": system.name, "rounds": args.overhead_rounds, "ttfts": ttfts, "median_ttft_ms": med,
            "mean_ttft_ms": {p: statistics.fmean(v) * 1000.0 for p, v in ttfts.items()},
            "overhead_ms": med["proxy"] - med["decoder"], "paired_median_ms": statistics.median(paired) * 1000.0,
            "commands": cmds}


def measure(up: list[Running], args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    results, commands = {}, {}
    for w in WORKLOADS:
        if w.name in args.workloads:
            results[w.name], commands[w.name] = run_rounds(
                w, up, args.rounds, run_dir, functools.partial(num_prompts, workload=w, scale=args.scale,
                                                              rounds=args.rounds))
    epd_specs = [r.spec for r in up if r.spec.name.startswith("epd-")]
    overhead = measure_overhead(epd_specs[0], args, run_dir) if epd_specs and args.overhead_rounds else None
    if overhead:
        commands[f"proxy overhead: {overhead['rounds']} rounds, alternating these two"] = overhead["commands"]
    return {"results": results, "commands": commands, "overhead": overhead}


def targets(s: dict[str, Any]) -> list[Target]:
    """Mean TTFT under repeated images, 4 images over 2 encoders, text throughput, and the proxy's overhead."""
    out = [Target(f"{w}_ttft_{e}_vs_aggregated", f"50 % repeated images, {rate}: mean TTFT, {e} / aggregated",
                  ratio(metric(s, e, "mean_ttft_ms", w), metric(s, "aggregated", "mean_ttft_ms", w)), 0.6, "<=")
           for w, rate in (("repeat50", "2 requests/s"), ("repeat50-light", "1 request/s")) for e in EPD_SYSTEMS]
    out.append(Target("images4_ttft_2enc_vs_1enc", "4 images per request: mean TTFT, 2 encoders / 1 encoder",
                      ratio(metric(s, "epd-2enc", "mean_ttft_ms", "images4"),
                            metric(s, "epd-1enc", "mean_ttft_ms", "images4")), 0.7, "<="))
    out += [Target(f"text_throughput_{e}_vs_aggregated", f"text only: output throughput, {e} / aggregated",
                   ratio(metric(s, e, "output_throughput", "text"), metric(s, "aggregated", "output_throughput", "text")),
                   0.9, ">=") for e in EPD_SYSTEMS]
    overhead = s.get("overhead")
    out.append(Target("proxy_overhead_ms", "proxy overhead: median TTFT via proxy - straight to the decoder (ms)",
                      None if overhead is None else float(overhead["overhead_ms"]), 2.0, "<="))
    return out


def plots(s: dict[str, Any], plots_dir: Path) -> dict[str, list[Path]]:
    """workload -> its PNGs (matplotlib imported only here)."""
    from epd_bench.plot import plot_latency_cdfs, plot_ttft_over_time

    out: dict[str, list[Path]] = {}
    for workload, runs in s["results"].items():
        if ok := {name: r for name, r in runs.items() if r.get("completed")}:
            metrics = ("ttft", "itl", "e2el") if workload != "text" else ("ttft", "tpot", "itl", "e2el")
            out[workload] = [plot_latency_cdfs(ok, plots_dir / f"{workload}_latency_cdf.png", metrics)]
            if workload == "repeat50":
                out[workload].append(plot_ttft_over_time(ok, plots_dir / f"{workload}_ttft_over_time.png"))
    if overhead := s.get("overhead"):
        runs = {p: {"ttfts": v} for p, v in overhead["ttfts"].items()}
        out["overhead"] = [plot_latency_cdfs(runs, plots_dir / "overhead_ttft_cdf.png", ("ttft",))]
    return out


def overhead_lines(s: dict[str, Any]) -> list[str]:
    if not (o := s.get("overhead")):
        return []
    med, mean, n = o["median_ttft_ms"], o["mean_ttft_ms"], {p: len(v) for p, v in o["ttfts"].items()}
    return [f"### Proxy overhead ({o['system']}): {OVERHEAD.title}", "",
            "epd-bench `--backend epd-decoder` talks to the decoder's own `POST /generate` (NDJSON); the same requests "
            "go through the proxy's `/v1/chat/completions`, in alternating rounds.", "",
            "| path | requests | median TTFT ms | mean TTFT ms |", "|---|---:|---:|---:|",
            *(f"| {p} | {n[p]} | {med[p]:.2f} | {mean[p]:.2f} |" for p in ("proxy", "decoder")),
            f"| **proxy − decoder** | | **{o['overhead_ms']:.2f}** | {mean['proxy'] - mean['decoder']:.2f} |", "",
            "Each round sends both paths the same prompts; the median of the per-prompt differences (proxy − decoder) "
            f"is **{o['paired_median_ms']:.2f} ms**, less noisy than the difference of the medians.", ""]


def render(s: dict[str, Any], plot_paths: dict[str, list[Path]], docs_dir: Path) -> str:
    def images(key: str) -> list[str]:
        return [f"![{p.stem}]({p.relative_to(docs_dir).as_posix()})" for p in plot_paths.get(key, [])] + [""]

    stalls = [f"{name} {r['p99_itl_ms']:.0f} ms" for name, r in s["results"].get("repeat50", {}).items()
              if r.get("completed")]
    body = [*target_rows(targets(s)), "Why a missed target is missed: see \"Side by side: why targets are missed\" "
            "below.", "", *([f"Streams decoding while new images arrive (`repeat50`), p99 inter-token latency: "
                             f"{', '.join(stalls)}.", ""] if stalls else []), "### Systems and pinning", "", *systems_table(s), "",
            f"Pinning `{s['pinning']}` (epd_bench/stacks.py): every system gets the same cores in all; a one-process "
            "system gets every core; EPD gives its encoders cores of their own (a second encoder on 2 cores shares "
            "core 0 with the decoder); the proxy and the client are not pinned. `transformers serve` gets fewer "
            "requests than the others (it runs vision-language requests one at a time).", "", *left_out(s)]
    for w in WORKLOADS:
        if w.name in s["results"]:
            body += [f"### Workload `{w.name}`: {w.title}", "", *workload_table(s, w.name), "", *images(w.name)]
    body += [*overhead_lines(s), *images("overhead"), *commands_block(s)]
    intro = ("Model `bench` (`epd_builders/bench_model.py`): random LLaVA, vision tower ViT-B/16 at 224² (86M "
             "parameters, 196 tokens per image), LM hidden 256 with 4 layers. Every system serves the same "
             "checkpoint; requests stream, greedy, every answer forced to its full length (`--ignore-eos`; `transformers "
             "serve` rejects it, so EOS is banned there with `logit_bias`). Prompt lengths are in words; token counts "
             f"are the servers'. Each workload runs in {s['rounds']} rounds that alternate the order of the systems "
             "(round r uses `--seed` + 100 r); each system's rounds are pooled (throughput = tokens / summed duration).")
    return section(NAME, "Side by side: aggregated, `transformers serve`, EPD with 1 and 2 encoders",
                   "make bench    # = .venv/bin/python -m epd_bench.compare", s, intro, body)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = RunStart.of(args)
    specs, not_started = build_systems(args, run.model_dir, run.pin)
    with started(rebuilt(specs, lambda: build_systems(args, run.model_dir, run.pin)[0]), run.run_dir / "logs") as (
            up, skipped):
        measured = measure(up, args, run.run_dir)
    skipped |= not_started
    summary = run.summary(args.model, specs, skipped, scale=args.scale, rounds=args.rounds, **measured)
    finish(summary, run.run_dir, targets(summary), format_targets(targets(summary), 72), None if args.no_docs else
           lambda: args.docs.write_text(render_docs(summary, args)), f"{args.docs} (marked section) and {args.plots_dir}")


def render_docs(summary: dict[str, Any], args: argparse.Namespace) -> str:
    from epd_bench.report import replace_section

    text = render(summary, plots(summary, args.plots_dir), args.docs.parent)
    return replace_section(args.docs.read_text(), text, f"<!-- {NAME}:begin -->", f"<!-- {NAME}:end -->")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser("python -m epd_bench.compare", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench", help="'bench' (built once, cached) or a checkpoint dir")
    p.add_argument("--systems", type=lambda s: tuple(s.split(",")), default=SYSTEMS,
                   help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--transformers-serve", type=Path, default=DEFAULT_TSERVE,
                   help="the `transformers` executable of a venv with transformers[serving]")
    p.add_argument("--pinning", choices=["split", "overlap", "none"], default="split", help="see epd_bench/stacks.py")
    p.add_argument("--workloads", type=lambda s: tuple(s.split(",")), default=tuple(w.name for w in WORKLOADS),
                   help="comma-separated subset of " + ",".join(w.name for w in WORKLOADS))
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's --num-prompts")
    p.add_argument("--rounds", type=int, default=2, help="rounds per workload, alternating the system order")
    p.add_argument("--baseline-decoder-flags", type=shlex.split, default=(),
                   help="also run aggregated and each EPD system as `<name>-base` with these epd-decoder flags, side "
                        "by side in the same rounds (e.g. an old default: \"--max-prefill-tokens 32\")")
    p.add_argument("--overhead-rounds", type=int, default=4)
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench")
    p.add_argument("--docs", type=Path, default=DOCS)
    p.add_argument("--plots-dir", type=Path, default=ROOT / "docs" / "bench")
    p.add_argument("--no-docs", action="store_true", help="print the targets, leave the docs alone")
    args = p.parse_args(argv)
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    return args


if __name__ == "__main__":
    main()
