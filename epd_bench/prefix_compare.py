"""The prefix-cache comparison behind `make bench-prefix`: the decoder's prefix cache on and off, EPD and aggregated.

    python -m epd_bench.prefix_compare [--scale 1.0] [--rounds 2] [--modes epd,aggregated] [--no-docs]

Four systems on `bench-lm` (a LM large enough that prefill, which the cache saves, outweighs a request's fixed
costs): EPD with one encoder and the aggregated decoder, each with the prefix cache on (the decoder's default)
and off (`--prefix-cache-bytes 0`), started together and measured one after another, workload by workload, in
rounds of alternating order (the machinery of epd_bench/compare.py). Workloads: `multi-turn` (conversations
resending their history, interleaved) and `shared-prefix` (one system prompt, distinct questions). Then, on the
cache-off systems, the premise is measured: a 1-word prompt's TTFT (the fixed overhead) against a first turn's
whose image is already encoded (its prefill). Results go to runs/bench-prefix/<time>/; the targets are printed
and docs/BENCHMARKS.md's `prefix-bench` section is regenerated.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import struct
import time
from pathlib import Path
from typing import Any

from epd_bench import prefix_report
from epd_bench.compare import (
    RunStart,
    Workload,
    epd_bench_cmd,
    finish,
    num_prompts,
    run_epd_bench,
    run_workload,
    start_measure_stop,
    systems_summary,
)
from epd_bench.prefix_report import MODES, system_name
from epd_bench.stacks import Running, SystemSpec, aggregated, epd

ROOT = Path(__file__).resolve().parents[1]
# NOTE: the first turn is a 100-word system prompt, one image and a 40-word question: about 740 tokens with the
# bench models' tokenizer (3.5 tokens a word); each later turn adds an answer and a question, about 180 tokens, so
# a cache saves most of a later turn's prefill. The system prompt is every conversation's (an application's).
# Sized so that `make bench-prefix` takes about 6 minutes on 2 cores (the cache-off runs take most of it).
TURN_TEXT = ("--system-prompt-len", "100", "--random-input-len", "40")  # words: the system prompt, each question
MULTI_TURN = Workload(
    "multi-turn", "4 turns per conversation, 1 image in the first, 3 conversations in flight",
    ("--dataset", "multi-turn", "--turns", "4", "--images-per-request", "1", *TURN_TEXT, "--random-output-len", "24",
     "--max-concurrency", "3", "--num-warmups", "1"), 24, 21)
SHARED_PREFIX = Workload(
    "shared-prefix", "the same 256-word system prompt, a distinct 20-word question, no image, 4 in flight",
    ("--dataset", "shared-prefix", "--system-prompt-len", "256", "--random-input-len", "20",
     "--random-output-len", "16", "--max-concurrency", "4", "--num-warmups", "1"), 24, 22)
WORKLOADS = (MULTI_TURN, SHARED_PREFIX)
# the premise, on the cache-off systems: one request at a time
ONE_WORD = Workload("one-word", "a 1-word text prompt", (
    "--dataset", "random", "--images-per-request", "0", "--random-input-len", "1", "--random-output-len", "4",
    "--max-concurrency", "1", "--num-warmups", "2"), 12, 23)
FIRST_TURN = Workload("first-turn", "a first turn whose image was encoded before (every request repeats it)", (
    "--dataset", "random", "--images-per-request", "1", "--repeat-ratio", "1", *TURN_TEXT, "--random-output-len", "4",
    "--max-concurrency", "1", "--num-warmups", "1"), 8, 24)
# 4 sequences in flight: 8 preallocated KV slots keep each decoder's memory small
DECODER_FLAGS = ("--max-num-seqs", "8")
CACHE_OFF = ("--prefix-cache-bytes", "0")


def build_systems(model_dir: Path, modes: tuple[str, ...], cores: int, pin: bool) -> list[SystemSpec]:
    specs = []
    for mode in modes:
        for cache in (True, False):
            flags = DECODER_FLAGS if cache else (*DECODER_FLAGS, *CACHE_OFF)
            name = system_name(mode, cache)
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


def calibrate(system: SystemSpec, scale: float, run_dir: Path) -> dict[str, Any]:
    """The fixed overhead (a 1-word prompt's median TTFT) and the first turn's (its image already encoded)."""
    out: dict[str, Any] = {"commands": {}}
    for w in (ONE_WORD, FIRST_TURN):
        n = max(3, num_prompts(system, w, scale, 1))
        cmd = epd_bench_cmd(system, w, n, w.seed, run_dir / "results", f"{w.name}-{system.name}.json")
        print(f"[{time.strftime('%H:%M:%S')}] {w.name} on {system.name}", flush=True)
        ms, tokens = _median_ms(run_epd_bench(cmd, run_dir / "epd-bench.log"), skip_first=w is FIRST_TURN)
        out["one_word_ms" if w is ONE_WORD else "first_turn_ms"] = ms
        if w is FIRST_TURN:
            out["first_turn_tokens"] = tokens
        out["commands"][w.name] = shlex.join(cmd)
    return out


def model_info(model_dir: Path) -> dict[str, Any]:
    """The LM's sizes from config.json, and its parameter count from the safetensors header (no torch here)."""
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    with (model_dir / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    params = sum(math.prod(v["shape"]) for k, v in header.items() if k.startswith("language_model."))
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    return {**{k: text[k] for k in keys}, "lm_params": params}


def measure(up: list[Running], args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    commands: dict[str, Any] = {}
    for w in WORKLOADS:
        if w.name in args.workloads:
            results[w.name], commands[w.name] = run_workload(w, up, args, run_dir)
    calibration: dict[str, Any] = {}
    for r in up:
        if r.spec.name.endswith(prefix_report.OFF) and args.calibrate:
            calibration[r.spec.name] = calibrate(r.spec, args.scale, run_dir)
            for name, cmd in calibration[r.spec.name].pop("commands").items():
                commands.setdefault(f"premise: {name}", {})[r.spec.name] = cmd
    return {"results": results, "commands": commands, "calibration": calibration}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started, run_dir, _, model_dir, pin = run = RunStart.of(args)
    specs = build_systems(model_dir, args.modes, len(os.sched_getaffinity(0)), pin)
    measured, skipped = start_measure_stop(specs, run_dir, started, lambda up: measure(up, args, run_dir))
    summary = {**run.summary_head(args.model, model_info(model_dir)),
               "scale": args.scale, "rounds": args.rounds, "skipped": skipped,
               "systems": systems_summary(specs, skipped),
               "workloads": {w.name: {"title": w.title} for w in WORKLOADS if w.name in args.workloads},
               **measured, "wall_s": round(time.monotonic() - started, 1)}
    finish(summary, run_dir, prefix_report.targets(summary), prefix_report.targets_text(summary),
           None if args.no_docs else lambda: prefix_report.write_docs(summary, args.docs),
           f"{args.docs} (prefix-bench section)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser("python -m epd_bench.prefix_compare", description=__doc__,
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
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    p.add_argument("--no-docs", action="store_true", help="print the targets, leave the docs alone")
    args = p.parse_args(argv)
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {','.join(MODES)}")
    if args.rounds < 1 or not args.scale > 0:
        p.error("--rounds must be >= 1 and --scale > 0")
    return args


if __name__ == "__main__":
    main()
