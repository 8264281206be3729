"""Video across encoders (issue 17's `make bench` row): TTFT of one 32-frame video, EPD with 2 encoders ÷ 1 encoder.

    python -m epd_bench.video_compare [--rounds 6] [--pinning split|none] [--no-docs]

Systems (epd_bench/stacks.py): EPD with 1 encoder and EPD with 2 encoders, one decoder each, on `bench-video`
(epd_builders/bench_model.py: a random Qwen2-VL whose vision tower makes a video's encode most of its TTFT).
Under "split" pinning each encoder has one core of its own where the machine has them (on 2 cores the second
encoder shares the decoder's, which waits for the video meanwhile) and runs one torch thread (OMP_NUM_THREADS=1),
so the 2-encoder system puts two cores to work on one video where the 1-encoder system has one; the proxy cuts
each video into chunks of 16 sampled frames (--video-chunk-frames), which the scheduler spreads over the encoders.
Both systems are started together and answer one warm-up video each, then the rounds alternate their order:
round r sends each system one request carrying a new clip (`epd-bench --videos-per-request 1 --video-frames 32`,
224x224 at 2 fps, seed + 100 r), the same clip to both; a new clip every round, so nothing is cached and every
TTFT includes encoding all 32 frames.

Frames per second per encoder come from each encoder's /metrics around every measured request: the frames it
encoded (the video's frames times its share of the chunks encoded for that request; the chunks are equal) over
the time it worked on them (decoding the frames, preprocessing them, the vision tower): its run seconds where it
reports them, else worked out from its calls' wall times (busy_seconds). Results go to runs/bench-video/<time>/;
the target is printed and the `video-bench` section of docs/BENCHMARKS.md is rewritten.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import struct
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from epd_bench import video_report
from epd_bench.compare import (
    ROOT,
    RunStart,
    Workload,
    epd_bench_cmd,
    finish,
    run_epd_bench,
    start_measure_stop,
    systems_summary,
)
from epd_bench.results import merge_results
from epd_bench.stacks import Running, SystemSpec, epd

FRAMES = 32
FRAME_SIZE = 224
CHUNK_FRAMES = 16
SYSTEMS = {"epd-1enc": 1, "epd-2enc": 2}
DECODER_FLAGS = ("--max-num-seqs", "4")  # one request at a time: a few KV slots keep the decoder small
PROXY_FLAGS = ("--video-chunk-frames", str(CHUNK_FRAMES))
VIDEO = Workload("video32", f"one request at a time, each with a new {FRAMES}-frame {FRAME_SIZE}x{FRAME_SIZE} video "
                 f"({FRAMES // 2} s at 2 fps), 16 words of text, 8 output tokens",
                 ("--images-per-request", "0", "--videos-per-request", "1", "--video-frames", str(FRAMES),
                  "--video-size", str(FRAME_SIZE), "--video-fps", "2", "--max-concurrency", "1",
                  "--random-input-len", "16", "--random-output-len", "8"), 1, 17)
WARM_UP_SEED = 16  # its item is never a measured one (measured rounds use the workload seed + 100 r)
RUN_SECONDS = "epd_encoder_run_seconds_total"  # time the encode thread ran calls, queueing excluded (if exposed)


class Counters(NamedTuple):
    """An encoder's /metrics figures this comparison reads (cumulative)."""

    items: float  # epd_encoder_items_encoded_total: chunks (and images) run through the vision tower
    call_seconds: float  # epd_encoder_encode_seconds_sum: wall time of the /encode calls, waiting included
    calls: float  # epd_encoder_encode_seconds_count
    run_seconds: float | None  # RUN_SECONDS; None when the encoder does not expose it


def build_systems(model_dir: Path, cores: int, pin: bool) -> list[SystemSpec]:
    return [epd(model_dir, n, cores, pin, decoder_flags=DECODER_FLAGS, name=name, proxy_flags=PROXY_FLAGS)
            for name, n in SYSTEMS.items()]


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of `name` in Prometheus text format (None when it has none)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{")]
    return sum(values) if values else None


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
    wall times. An encoder runs one call at a time (one encode thread) and the proxy sends a video's chunks at
    once, one call each, so k equal calls last d, 2d, ..., kd (each waits for those before it): their sum is
    d k (k + 1) / 2 and the encoder worked k d = 2 sum / (k + 1)."""
    if before.run_seconds is not None and after.run_seconds is not None:
        return after.run_seconds - before.run_seconds
    k = after.calls - before.calls
    return 2 * (after.call_seconds - before.call_seconds) / (k + 1) if k > 0 else 0.0


def encoder_work(before: dict[str, Counters], after: dict[str, Counters], frames: int) -> dict[str, dict[str, float]]:
    """Per encoder, what one request made it do: {"frames", "seconds"}; the video's frames shared out by the
    chunks each encoder encoded (empty when no chunk was encoded)."""
    items = {name: after[name].items - before[name].items for name in after}
    total = sum(items.values())
    if total <= 0:
        return {}
    return {name: {"frames": frames * items[name] / total, "seconds": busy_seconds(before[name], after[name])}
            for name in after}


def add_work(into: dict[str, dict[str, float]], work: dict[str, dict[str, float]]) -> None:
    for name, w in work.items():
        acc = into.setdefault(name, {"frames": 0.0, "seconds": 0.0})
        acc["frames"] += w["frames"]
        acc["seconds"] += w["seconds"]


def frames_per_second(work: dict[str, dict[str, float]]) -> dict[str, float | None]:
    return {name: w["frames"] / w["seconds"] if w["seconds"] > 0 else None for name, w in work.items()}


def run_one(cmd: list[str], log: Path) -> dict[str, Any]:
    """One epd-bench run's result; a run that failed as a whole (exit status != 0) as {"error": ...}."""
    try:
        return run_epd_bench(cmd, log)
    except subprocess.CalledProcessError as exc:  # the other system still runs; the table shows why
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        return {"error": f"epd-bench exited {exc.returncode}: {' '.join(tail)[-300:]}"}


def merge_rounds(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' results pooled (merge_results); a run that failed as a whole counts as one failed request."""
    runs = [x for x in parts if "successes" in x]
    broken = [x["error"] for x in parts if "successes" not in x]
    if not runs:
        return {"completed": 0, "failed": len(broken), "errors": broken}
    merged = merge_results(runs)
    return {**merged, "failed": merged["failed"] + len(broken), "errors": [*merged["errors"], *broken]}


def measure(up: list[Running], args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """A warm-up video per system, then the rounds (alternating order); TTFTs pooled, encoder work summed."""
    measured = measure_rounds(up, args.rounds, run_dir, VIDEO, FRAMES, "video")
    return {**measured, "frames_per_s": {name: frames_per_second(w) for name, w in measured["encoder_work"].items()}}


def measure_rounds(up: list[Running], rounds: int, run_dir: Path, workload: Workload, units: int,
                   prefix: str) -> dict[str, Any]:
    """A warm-up request per system, then `rounds` measured ones (alternating the systems' order), each carrying one
    new item of `units` (a video's frames, a clip's seconds): their results merged per system, and each encoder's
    work (its share of the units, its seconds working: `encoder_work`) summed over the rounds that succeeded."""
    results_dir, log = run_dir / "results", run_dir / "epd-bench.log"
    commands: dict[str, dict[str, str]] = {"warm-up": {}, workload.name: {}}
    warm_up_errors = {}
    for r in up:
        print(f"[{time.strftime('%H:%M:%S')}] warm-up on {r.spec.name}", flush=True)
        cmd = epd_bench_cmd(r.spec, workload, 1, WARM_UP_SEED, results_dir, f"warm-up-{r.spec.name}.json")
        commands["warm-up"][r.spec.name] = shlex.join(cmd)
        if error := run_one(cmd, log).get("error"):
            warm_up_errors[r.spec.name] = error
    parts: dict[str, list[dict[str, Any]]] = {r.spec.name: [] for r in up}
    work: dict[str, dict[str, dict[str, float]]] = {r.spec.name: {} for r in up}
    busy_from: set[str] = set()
    for rnd in range(rounds):
        for r in up if rnd % 2 == 0 else up[::-1]:
            cmd = epd_bench_cmd(r.spec, workload, 1, workload.seed + 100 * rnd, results_dir,
                                f"{prefix}-{r.spec.name}-{rnd}.json")
            print(f"[{time.strftime('%H:%M:%S')}] round {rnd} on {r.spec.name}", flush=True)
            commands[workload.name][r.spec.name] = shlex.join(cmd)
            before = encoder_counters(r.spec)
            result = run_one(cmd, log)
            parts[r.spec.name].append(result)
            if all(result.get("successes") or [False]):
                after = encoder_counters(r.spec)
                add_work(work[r.spec.name], encoder_work(before, after, units))
                busy_from |= {"run seconds" if c.run_seconds is not None else "call wall times" for c in after.values()}
    return {"results": {name: merge_rounds(p) for name, p in parts.items()}, "encoder_work": work,
            "busy_from": sorted(busy_from), "warm_up_errors": warm_up_errors, "commands": commands}


def model_info(model_dir: Path) -> dict[str, Any]:
    """The vision tower's and the LM's sizes from config.json, parameters from the safetensors header (no torch)."""
    config = json.loads((model_dir / "config.json").read_text())
    vision, text = config["vision_config"], config["text_config"]
    with (model_dir / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    params = {part: sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__" and
                        (k.startswith("visual.") if part == "vision" else not k.startswith("visual.")))
              for part in ("vision", "lm")}
    return {"family": config.get("model_type"), "vision_depth": vision["depth"], "vision_width": vision["embed_dim"],
            "vision_mlp_ratio": vision.get("mlp_ratio", 4), "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"], "merge_size": vision.get("spatial_merge_size", 2),
            "lm_hidden": text["hidden_size"],
            "lm_layers": text["num_hidden_layers"], "vision_params": params["vision"], "lm_params": params["lm"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started, run_dir, _, model_dir, pin = run = RunStart.of(args)
    specs = build_systems(model_dir, len(os.sched_getaffinity(0)), pin)
    measured, skipped = start_measure_stop(specs, run_dir, started, lambda up: measure(up, args, run_dir))
    summary = {**run.summary_head(args.model, model_info(model_dir)),
               "rounds": args.rounds, "frames": FRAMES, "frame_size": FRAME_SIZE, "chunk_frames": CHUNK_FRAMES,
               "skipped": skipped,
               "systems": systems_summary(specs, skipped), "workload": {"name": VIDEO.name, "title": VIDEO.title},
               **measured, "wall_s": round(time.monotonic() - started, 1)}
    finish(summary, run_dir, video_report.targets(summary), video_report.targets_text(summary),
           None if args.no_docs else lambda: video_report.write_docs(summary, args.docs),
           f"{args.docs} (video-bench section)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return encoder_compare_args(argv, "python -m epd_bench.video_compare", __doc__, "bench-video",
                                "a model that takes video", "bench-video")


def encoder_compare_args(argv: list[str] | None, prog: str, doc: str | None, model: str, takes: str,
                         runs: str) -> argparse.Namespace:
    """The flags of a 2-encoder ÷ 1-encoder comparison (video, audio): `model` the preset built by default, `takes`
    what another checkpoint must take, `runs` its folder under runs/."""
    p = argparse.ArgumentParser(prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=model, help=f"'{model}' (built once, cached) or a checkpoint dir of {takes}")
    p.add_argument("--pinning", choices=["split", "none"], default="split", help="see epd_bench/stacks.py")
    p.add_argument("--rounds", type=int, default=6, help="measured requests per system, alternating the order")
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / runs)
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    p.add_argument("--no-docs", action="store_true", help="print the target, leave the docs alone")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


if __name__ == "__main__":
    main()
