"""The prefix-cache comparison behind `make bench-prefix`: the decoder's prefix cache on and off, EPD and aggregated.

    python -m epd_bench.prefix_compare [--scale 1.0] [--rounds 2] [--modes epd,aggregated] [--no-docs]

Four systems on `bench-lm` (a LM large enough that prefill, which the cache saves, outweighs a request's fixed
costs): EPD with one encoder and the aggregated decoder, each with the prefix cache on (the decoder's default) and
off (`--prefix-cache-bytes 0`), started together and measured in rounds of alternating order (epd_bench/loads.py).
Workloads: `multi-turn` (conversations resending their history, interleaved) and `shared-prefix` (one system prompt,
distinct questions). Then, on the cache-off systems, the premise: a 1-word prompt's TTFT (the fixed overhead)
against a first turn's whose image is already encoded (its prefill). Targets, per mode: mean TTFT of turns >= 2,
cache on ÷ off (<= 0.3); shared-prefix requests/s, on ÷ off (>= 1.5); prefill ÷ overhead (>= 5). Results go to
runs/bench-prefix/<time>/; docs/BENCHMARKS.md's `prefix-bench` section is regenerated.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

from epd_bench.loads import Workload, epd_bench_cmd, num_prompts, run_epd_bench, run_rounds
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
    param_counts,
    ratio,
    section,
    target_rows,
    workload_table,
    write_section,
)
from epd_bench.stacks import Running, RunStart, SystemSpec, aggregated, epd, rebuilt, started

NAME = "prefix-bench"
MODES = ("epd", "aggregated")
ON, OFF = "cache", "nocache"  # system names are f"{mode}-{ON}" and f"{mode}-{OFF}"
# the first turn: a 100-word system prompt, one image and a 40-word question (about 740 tokens with the bench models'
# tokenizer); each later turn adds an answer and a question (about 180), so a cache saves most of its prefill
TURN_TEXT = ("--system-prompt-len", "100", "--random-input-len", "40")
WORKLOADS = (
    Workload("multi-turn", "4 turns per conversation, 1 image in the first, 3 conversations in flight",
             ("--dataset", "multi-turn", "--turns", "4", "--images-per-request", "1", *TURN_TEXT,
              "--random-output-len", "24", "--max-concurrency", "3", "--num-warmups", "1"), 24, 21),
    Workload("shared-prefix", "the same 256-word system prompt, a distinct 20-word question, no image, 4 in flight",
             ("--dataset", "shared-prefix", "--system-prompt-len", "256", "--random-input-len", "20",
              "--random-output-len", "16", "--max-concurrency", "4", "--num-warmups", "1"), 24, 22))
ONE_WORD = Workload("one-word", "a 1-word text prompt", (
    "--dataset", "random", "--images-per-request", "0", "--random-input-len", "1", "--random-output-len", "4",
    "--max-concurrency", "1", "--num-warmups", "2"), 12, 23)
FIRST_TURN = Workload("first-turn", "a first turn whose image was encoded before (every request repeats it)", (
    "--dataset", "random", "--images-per-request", "1", "--repeat-ratio", "1", *TURN_TEXT, "--random-output-len", "4",
    "--max-concurrency", "1", "--num-warmups", "1"), 8, 24)
DECODER_FLAGS = ("--max-num-seqs", "8")  # 4 sequences in flight: 8 preallocated KV slots keep each decoder small
CACHE_OFF = ("--prefix-cache-bytes", "0")
COLUMNS = {"req/s": ("request_throughput", 2), "output tok/s": ("output_throughput", 1),
           "mean TTFT": ("mean_ttft_ms", 1), "mean TTFT turn 1": ("mean_ttft_ms_turn1", 1),
           "mean TTFT turns ≥ 2": ("mean_ttft_ms_turn2plus", 1),
           "mean prompt tokens turns ≥ 2": ("mean_prompt_tokens_turn2plus", 1),
           "mean cached tokens turns ≥ 2": ("mean_cached_tokens_turn2plus", 1),
           "mean cached tokens": ("mean_cached_tokens", 1), "median ITL": ("median_itl_ms", 1)}


def system_name(mode: str, cache: bool) -> str:
    return f"{mode}-{ON if cache else OFF}"


def build_systems(model_dir: Path, modes: tuple[str, ...], cores: int, pin: bool) -> list[SystemSpec]:
    specs = []
    for mode in modes:
        for cache in (True, False):
            flags, name = DECODER_FLAGS if cache else (*DECODER_FLAGS, *CACHE_OFF), system_name(mode, cache)
            specs.append(epd(model_dir, 1, cores, pin, decoder_flags=flags, name=name) if mode == "epd"
                         else aggregated(model_dir, cores, pin, decoder_flags=flags, name=name))
    return specs


def _median_ms(result: dict[str, Any], skip_first: bool) -> tuple[float | None, int]:
    """Median TTFT (ms) and prompt tokens of the successful requests (without the first, which encoded the image)."""
    rows = [(t, n) for t, n, ok in zip(result["ttfts"], result["input_lens"], result["successes"], strict=True)
            if ok][1 if skip_first else 0:]
    if not rows:
        return None, 0
    return statistics.median(t for t, _ in rows) * 1000.0, round(statistics.median(n for _, n in rows))


def calibrate(system: SystemSpec, scale: float, run_dir: Path, commands: dict[str, Any]) -> dict[str, Any]:
    """The fixed overhead (a 1-word prompt's median TTFT) and the first turn's (its image already encoded)."""
    out: dict[str, Any] = {}
    for w in (ONE_WORD, FIRST_TURN):
        cmd = epd_bench_cmd(system, w, max(3, num_prompts(system, w, scale, 1)), w.seed, run_dir / "results",
                            f"{w.name}-{system.name}.json")
        print(f"[{time.strftime('%H:%M:%S')}] {w.name} on {system.name}", flush=True)
        ms, tokens = _median_ms(run_epd_bench(cmd, run_dir / "epd-bench.log"), skip_first=w is FIRST_TURN)
        out |= {"first_turn_ms": ms, "first_turn_tokens": tokens} if w is FIRST_TURN else {"one_word_ms": ms}
        commands.setdefault(f"premise: {w.name}", {})[system.name] = shlex.join(cmd)
    return out


def measure(up: list[Running], args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    commands: dict[str, Any] = {}
    for w in WORKLOADS:
        if w.name in args.workloads:
            results[w.name], commands[w.name] = run_rounds(
                w, up, args.rounds, run_dir, functools.partial(num_prompts, workload=w, scale=args.scale,
                                                              rounds=args.rounds))
    calibration = {r.spec.name: calibrate(r.spec, args.scale, run_dir, commands)
                   for r in up if r.spec.name.endswith(OFF) and args.calibrate}
    return {"results": results, "commands": commands, "calibration": calibration}


def prefill_over_overhead(c: dict[str, Any] | None) -> float | None:
    """(first turn's TTFT with its image already encoded - a 1-word prompt's TTFT) / the 1-word prompt's TTFT."""
    if not c or not c.get("one_word_ms") or c.get("first_turn_ms") is None:
        return None
    return (float(c["first_turn_ms"]) - c["one_word_ms"]) / float(c["one_word_ms"])


def targets(s: dict[str, Any]) -> list[Target]:
    out = []
    for mode in MODES:
        on, off = system_name(mode, True), system_name(mode, False)
        if on not in s["systems"] and off not in s["systems"]:
            continue
        out += [Target(f"{mode}_multi_turn_ttft_turn2plus", f"{mode}: mean TTFT of turns ≥ 2, cache on ÷ off",
                       ratio(metric(s, on, "mean_ttft_ms_turn2plus", "multi-turn"),
                             metric(s, off, "mean_ttft_ms_turn2plus", "multi-turn")), 0.3, "<="),
                Target(f"{mode}_shared_prefix_throughput", f"{mode}: shared system prompt, requests/s, cache on ÷ off",
                       ratio(metric(s, on, "request_throughput", "shared-prefix"),
                             metric(s, off, "request_throughput", "shared-prefix")), 1.5, ">="),
                Target(f"{mode}_prefill_vs_overhead", f"{mode}: first turn's prefill ÷ fixed per-request overhead",
                       prefill_over_overhead(s.get("calibration", {}).get(off)), 5.0, ">=")]
    return out


def render(s: dict[str, Any]) -> str:
    lm = s["model_info"]
    calibration = ["| mode | 1-word prompt: median TTFT ms | first turn, image already encoded: median TTFT ms "
                   "| its prompt tokens | prefill ÷ overhead |", "|---|---:|---:|---:|---:|"]
    for mode in MODES:
        if c := s.get("calibration", {}).get(system_name(mode, False)):
            calibration.append(f"| {mode} | {fmt(c['one_word_ms'])} | {fmt(c['first_turn_ms'])} | "
                               f"{c['first_turn_tokens']} | {fmt(prefill_over_overhead(c))} |")
    body = [*target_rows(targets(s)), "### Fixed overhead and the first turn's prefill (cache off)", "",
            "The fixed per-request overhead is the median TTFT of a 1-word text prompt through the proxy; the first "
            "turn's cost, the median TTFT of a first-turn-shaped prompt whose image was already encoded, so it times "
            "prefill, not the vision tower.", "", *calibration, "", *left_out(s)]
    for w in WORKLOADS:
        if w.name in s["results"]:
            body += [f"### Workload `{w.name}`: {w.title}", "", *workload_table(s, w.name, COLUMNS), ""]
    intro = (f"Model `{s['model']}` (`epd_builders/bench_model.py`): the `bench` vision tower (ViT-B/16, 196 tokens "
             f"per image) and a random Llama LM with hidden {lm['hidden_size']}, {lm['num_hidden_layers']} layers, "
             f"{lm['num_attention_heads']} query and {lm['num_key_value_heads']} K/V heads, MLP "
             f"{lm['intermediate_size']}: {lm['lm_params'] / 1e6:.1f}M parameters. Systems: EPD (1 encoder) and the "
             "aggregated decoder, each with the prefix cache on (its default) and off (`--prefix-cache-bytes 0`), in "
             f"{s['rounds']} round(s) of alternating order, pooled. With the cache off, cached tokens are still "
             "reported for images whose embeddings the decoder already held (196 per image).")
    return section(NAME, "Prefix cache: multi-turn and shared system prompt, cache on and off",
                   "make bench-prefix    # = .venv/bin/python -m epd_bench.prefix_compare", s, intro,
                   [*body, *commands_block(s)])


def model_info(model_dir: Path) -> dict[str, Any]:
    """The LM's sizes from config.json, and its parameter count from the safetensors header (no torch here)."""
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    params = param_counts(model_dir, lambda k: "lm" if k.startswith("language_model.") else "other")
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    return {**{k: text[k] for k in keys}, "lm_params": params.get("lm", 0)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = RunStart.of(args)
    cores = len(os.sched_getaffinity(0))
    specs = build_systems(run.model_dir, args.modes, cores, run.pin)
    rebuild = rebuilt(specs, lambda: build_systems(run.model_dir, args.modes, cores, run.pin))
    with started(rebuild, run.run_dir / "logs") as (up, skipped):
        measured = measure(up, args, run.run_dir)
    s = run.summary(args.model, specs, skipped, model_info=model_info(run.model_dir), scale=args.scale,
                    rounds=args.rounds, **measured)
    finish(s, run.run_dir, targets(s), format_targets(targets(s)),
           None if args.no_docs else lambda: write_section(args.docs, NAME, render(s)), f"{args.docs} ({NAME})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser("python -m epd_bench.prefix_compare", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-lm", help="'bench-lm' (built once, cached), 'bench' or a checkpoint dir")
    p.add_argument("--modes", type=lambda s: tuple(s.split(",")), default=MODES,
                   help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--workloads", type=lambda s: tuple(s.split(",")), default=tuple(w.name for w in WORKLOADS),
                   help="comma-separated subset of " + ",".join(w.name for w in WORKLOADS))
    p.add_argument("--pinning", choices=["split", "none"], default="split", help="see epd_bench/stacks.py")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's request count")
    p.add_argument("--rounds", type=int, default=2, help="rounds per workload, alternating the system order")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="skip the 1-word / first-turn TTFT measurement")
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench-prefix")
    p.add_argument("--docs", type=Path, default=DOCS)
    p.add_argument("--no-docs", action="store_true", help="print the targets, leave the docs alone")
    args = p.parse_args(argv)
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {','.join(MODES)}")
    if args.rounds < 1 or not args.scale > 0:
        p.error("--rounds must be >= 1 and --scale > 0")
    return args


if __name__ == "__main__":
    main()
