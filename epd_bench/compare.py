"""The side-by-side comparison behind `make bench`: the same model and workloads against every system, one run.

    python -m epd_bench.compare [--scale 1.0] [--pinning split|none] [--no-docs]

Systems (epd_bench/stacks.py; started together, then measured one after another, workload by workload, so
machine noise hits them alike): the aggregated baseline (one decoder that encodes and decodes),
`transformers serve` with the same checkpoint (from its own venv, when installed), and EPD with 1 and 2
encoders. Workloads are epd-bench runs (each command is kept and printed in the docs). Results go to
runs/bench/<time>/; the targets are printed, and docs/BENCHMARKS.md's marked section and docs/bench/*.png
are regenerated.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from epd_bench import report
from epd_bench.results import merge_results
from epd_bench.stacks import Running, SystemSpec, aggregated, epd, transformers_serve

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TSERVE = ROOT / "runs" / "tserve-venv" / "bin" / "transformers"
SYSTEMS = ("aggregated", "transformers-serve", "epd-1enc", "epd-2enc")


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    flags: tuple[str, ...]  # epd-bench flags besides the target's, --num-prompts and --seed
    num_prompts: int  # in all, over the rounds
    seed: int  # round r uses seed + 100 r: new prompts and images each round
    # NOTE: transformers serve runs VLM requests one at a time (see ../shared/notes); a capped run keeps
    # `make bench` within its time budget, and the tables say how many requests each system got
    slow_prompts: int | None = None


WORKLOADS = (
    # NOTE: 2 requests/s is near what these systems sustain here (~2.2/s), where encodes queue; at 1/s a new
    # image's TTFT is mostly one encode, so that run shows single-image latency under light load instead
    Workload("repeat50", "1 image per request, 50 % of images repeated, Poisson arrivals at 2 requests/s",
             ("--images-per-request", "1", "--repeat-ratio", "0.5", "--request-rate", "2",
              "--random-input-len", "32", "--random-output-len", "32", "--num-warmups", "2"), 40, 1, 6),
    Workload("repeat50-light", "as `repeat50`, at 1 request/s",
             ("--images-per-request", "1", "--repeat-ratio", "0.5", "--request-rate", "1",
              "--random-input-len", "32", "--random-output-len", "32", "--num-warmups", "2"), 24, 5, 4),
    Workload("images4", "4 new images per request, one request at a time",
             ("--images-per-request", "4", "--max-concurrency", "1", "--random-input-len", "32",
              "--random-output-len", "16", "--num-warmups", "1"), 8, 2, 2),
    Workload("text", "text only, 16 requests in flight",
             ("--images-per-request", "0", "--max-concurrency", "16", "--random-input-len", "32",
              "--random-output-len", "64", "--num-warmups", "2"), 64, 3, 8),
)
OVERHEAD = Workload("overhead", "text only, one request at a time, 16 output tokens: proxy vs straight to the decoder",
                    ("--images-per-request", "0", "--max-concurrency", "1", "--random-input-len", "32",
                     "--random-output-len", "16", "--num-warmups", "3"), 64, 4)


def num_prompts(system: SystemSpec, workload: Workload, scale: float, rounds: int) -> int:
    """Requests per round for this system."""
    n = workload.num_prompts
    if system.name == "transformers-serve" and workload.slow_prompts is not None:
        n = min(n, workload.slow_prompts)
    return max(1, round(n * scale / rounds))


def epd_bench_cmd(system: SystemSpec, workload: Workload, num: int, seed: int, result_dir: Path, filename: str,
                  direct: bool = False) -> list[str]:
    exe = Path(sys.executable).parent / "epd-bench"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "epd_bench.serve"]
    target = (["--backend", "epd-decoder", "--base-url", str(system.decoder_url)] if direct
              else ["--base-url", system.url, "--model", system.model])
    eos = ["--ignore-eos"] if system.ignore_eos else ["--extra-body", json.dumps(system.openai_extra)]
    return [*base, *target, *workload.flags, "--num-prompts", str(num), "--seed", str(seed), *eos, "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename, "--label", system.name]


def run_epd_bench(cmd: list[str], log: Path) -> dict[str, Any]:
    """Run one epd-bench command (its console report goes to `log`); returns its result JSON."""
    with log.open("ab") as out:
        out.write(f"$ {shlex.join(cmd)}\n".encode())
        out.flush()
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True)
    i = cmd.index("--result-dir")
    return dict(json.loads((Path(cmd[i + 1]) / cmd[cmd.index("--result-filename") + 1]).read_text()))


def build_systems(args: argparse.Namespace, model_dir: Path) -> tuple[list[SystemSpec], dict[str, str]]:
    """The systems asked for, and why any of them is left out."""
    cores, pin = len(os.sched_getaffinity(0)), args.pinning != "none"
    specs, skipped = [], {}
    for name in args.systems:
        if name == "aggregated":
            specs.append(aggregated(model_dir, cores, pin))
        elif name.startswith("epd-"):
            specs.append(epd(model_dir, int(name[4:-3]), cores, pin, decoder_all_cores=args.pinning == "overlap"))
        elif not args.transformers_serve.exists():
            skipped[name] = (f"not installed: {args.transformers_serve} is missing (`make bench` installs it into "
                             "runs/tserve-venv; see runs/tserve-install.log)")
        else:
            eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
            specs.append(transformers_serve(args.transformers_serve, model_dir, int(eos), cores, pin))
    return specs, skipped


def wait_all(running: list[Running], log_dir: Path, skipped: dict[str, str]) -> list[Running]:
    """Wait for every started system; one that fails is left out, with its log's tail as the reason."""
    up = []
    for r in running:
        try:
            r.wait_healthy(600)
            up.append(r)
        except (RuntimeError, TimeoutError) as exc:
            tail = "".join((log_dir / f"{r.spec.name}-{p.name}.log").read_text(errors="replace")[-800:]
                           for p in r.spec.procs)
            skipped[r.spec.name] = f"{exc}: {tail.strip()}"
            r.stop()
    return up


def measure_overhead(system: SystemSpec, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Rounds alternating proxy and direct-to-decoder epd-bench runs (same prompts); TTFT samples pooled per path."""
    ttfts: dict[str, list[float]] = {"proxy": [], "decoder": []}
    cmds: dict[str, list[str]] = {}
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
            cmds[path] = cmd
        paired += [a - b for a, b in zip(got["proxy"], got["decoder"], strict=True) if a is not None and b is not None]
    med = {p: statistics.median(v) * 1000.0 for p, v in ttfts.items()}
    return {"system": system.name, "rounds": args.overhead_rounds, "ttfts": ttfts, "median_ttft_ms": med,
            "mean_ttft_ms": {p: statistics.fmean(v) * 1000.0 for p, v in ttfts.items()},
            "overhead_ms": med["proxy"] - med["decoder"], "paired_median_ms": statistics.median(paired) * 1000.0,
            "commands": {p: shlex.join(c) for p, c in cmds.items()}}


def run_workload(w: Workload, up: list[Running], args: argparse.Namespace,
                 run_dir: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Rounds in alternating system order; returns system -> merged result, system -> last command."""
    parts: dict[str, list[dict[str, Any]]] = {r.spec.name: [] for r in up}
    commands: dict[str, str] = {}
    for rnd in range(args.rounds):
        for r in up if rnd % 2 == 0 else up[::-1]:
            cmd = epd_bench_cmd(r.spec, w, num_prompts(r.spec, w, args.scale, args.rounds), w.seed + 100 * rnd,
                                run_dir / "results", f"{w.name}-{r.spec.name}-{rnd}.json")
            print(f"[{time.strftime('%H:%M:%S')}] {w.name} round {rnd} on {r.spec.name}", flush=True)
            commands[r.spec.name] = shlex.join(cmd)
            try:
                parts[r.spec.name].append(run_epd_bench(cmd, run_dir / "epd-bench.log"))
            except subprocess.CalledProcessError as exc:  # the others still run; the table shows the failure
                parts[r.spec.name].append({"completed": 0, "error": f"epd-bench exited {exc.returncode}"})
    merged = {name: merge_results(p) if all(x.get("completed") for x in p) else {"completed": 0, "failed": "?"}
              for name, p in parts.items()}
    return merged, commands


def run_workloads(up: list[Running], args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    commands: dict[str, Any] = {}
    for w in WORKLOADS:
        if w.name in args.workloads:
            results[w.name], commands[w.name] = run_workload(w, up, args, run_dir)
    epd_systems = [r.spec for r in up if r.spec.name.startswith("epd-")]
    overhead = measure_overhead(epd_systems[0], args, run_dir) if epd_systems and args.overhead_rounds else None
    return {"results": results, "commands": commands, "overhead": overhead}


def start_measure_stop(specs: list[SystemSpec], run_dir: Path, started: float,
                       measure: Callable[[list[Running]], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Start every system at once (start-up overlaps), `measure` those that came up, stop them all (also on Ctrl-C
    during start-up: no worker outlives the comparison); (what was measured with `startup_s`, why any was left out)."""
    skipped: dict[str, str] = {}
    running = [Running(spec, run_dir / "logs") for spec in specs]
    try:
        up = wait_all(running, run_dir / "logs", skipped)
        startup_s = round(time.monotonic() - started, 1)
        print(f"[{time.strftime('%H:%M:%S')}] up after {startup_s} s: {[r.spec.name for r in up]}; "
              f"left out: {list(skipped)}", flush=True)
        return {**measure(up), "startup_s": startup_s}, skipped
    finally:
        for r in running:
            r.stop()


class RunStart(NamedTuple):
    """A comparison's start: its clock, its run folder, the load before it, the checkpoint, whether to pin."""

    started: float
    run_dir: Path
    load_before: tuple[float, ...]
    model_dir: Path
    pin: bool

    @classmethod
    def of(cls, args: argparse.Namespace) -> RunStart:
        """From a comparison's --model, --out-dir and --pinning (split pins only where taskset is found)."""
        started = time.monotonic()
        run_dir = args.out_dir / datetime.now().strftime("%Y%m%d-%H%M%S")
        load_before = os.getloadavg()
        return cls(started, run_dir, load_before, resolve_model(args.model),
                   args.pinning != "none" and shutil.which("taskset") is not None)

    def summary_head(self, model: str, model_info: dict[str, Any]) -> dict[str, Any]:
        """What the comparison's summary starts with: when, which model, the machine, its load before and after the
        run, and the pinning."""
        return {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "model": model, "model_dir": str(self.model_dir),
                "model_info": model_info, "cores": len(os.sched_getaffinity(0)), "load_before": self.load_before,
                "load_after": os.getloadavg(), "pinning": "split" if self.pin else "none"}


def systems_summary(specs: list[SystemSpec], skipped: dict[str, str]) -> dict[str, Any]:
    """Each started system's processes as run (cores, threads, command line), for the summary and the docs."""
    return {s.name: [{"name": p.name, "cpus": p.cpus, "threads": p.threads, "command": p.shell()} for p in s.procs]
            for s in specs if s.name not in skipped}


def resolve_model(name: str) -> Path:
    """The checkpoint dir, via a child process so this one never imports torch."""
    out = subprocess.run([sys.executable, "-c", "import sys; from epd_models.resolve import resolve_model; "
                          "print(resolve_model(sys.argv[1]))", name], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    run_dir = args.out_dir / datetime.now().strftime("%Y%m%d-%H%M%S")
    load_before = os.getloadavg()
    model_dir = resolve_model(args.model)
    if args.pinning != "none" and shutil.which("taskset") is None:
        print("taskset not found: running unpinned (--pinning none)", flush=True)
        args.pinning = "none"
    specs, not_started = build_systems(args, model_dir)
    measured, skipped = start_measure_stop(specs, run_dir, started, lambda up: run_workloads(up, args, run_dir))
    skipped.update(not_started)
    summary = {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "model": args.model, "model_dir": str(model_dir),
               "cores": len(os.sched_getaffinity(0)), "load_before": load_before, "load_after": os.getloadavg(),
               "pinning": args.pinning, "scale": args.scale, "rounds": args.rounds, "skipped": skipped,
               "systems": systems_summary(specs, skipped),
               "workloads": {w.name: {"title": w.title} for w in WORKLOADS if w.name in args.workloads},
               "overhead_title": OVERHEAD.title,
               **measured, "wall_s": round(time.monotonic() - started, 1)}
    finish(summary, run_dir, report.targets(summary), report.targets_text(summary),
           None if args.no_docs else lambda: report.write_docs(summary, args.docs, args.plots_dir),
           f"{args.docs} (marked section) and {args.plots_dir}/*.png")


def finish(summary: dict[str, Any], run_dir: Path, found: list[report.Target], text: str,
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser("python -m epd_bench.compare", description=__doc__,
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
    p.add_argument("--overhead-rounds", type=int, default=4)
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench")
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    p.add_argument("--plots-dir", type=Path, default=ROOT / "docs" / "bench")
    p.add_argument("--no-docs", action="store_true", help="print the targets, leave the docs alone")
    args = p.parse_args(argv)
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    return args


if __name__ == "__main__":
    main()
