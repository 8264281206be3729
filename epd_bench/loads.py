"""Runs a comparison's loads: epd-bench workloads against started systems, in rounds of alternating order, pooled.

The rounds alternate the order of the systems (A B C, then C B A), so load from other users of a shared machine
lands on every system alike; pooling a system's rounds adds up their durations, so throughput is total tokens over
total time. Every load is an `epd-bench` command, kept so the docs can show it.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import httpx

from epd_bench.backends import RequestOutput
from epd_bench.metrics import calculate_metrics, tpot
from epd_bench.stacks import Running, SystemSpec

PERCENTILES = [50.0, 90.0, 99.0]
Timed = tuple[float, RequestOutput]  # (perf_counter when a request was sent, its output)


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    flags: tuple[str, ...]  # epd-bench flags besides the target's, --num-prompts and --seed
    num_prompts: int  # in all, over the rounds
    seed: int  # round r uses seed + 100 r: new prompts and media each round
    slow_prompts: int | None = None  # the cap for `transformers serve`, which runs VLM requests one at a time


def num_prompts(system: SystemSpec, workload: Workload, scale: float, rounds: int) -> int:
    """Requests per round for this system."""
    n = workload.num_prompts
    if system.name == "transformers-serve" and workload.slow_prompts is not None:
        n = min(n, workload.slow_prompts)
    return max(1, round(n * scale / rounds))


def epd_bench_cmd(system: SystemSpec, workload: Workload, num: int, seed: int, result_dir: Path, filename: str,
                  direct: bool = False) -> list[str]:
    """The epd-bench command line of one run (direct: straight to the EPD decoder's own API)."""
    exe = Path(sys.executable).parent / "epd-bench"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "epd_bench.serve"]
    target = (["--backend", "epd-decoder", "--base-url", str(system.decoder_url)] if direct
              else ["--base-url", system.url, "--model", system.model])
    eos = ["--ignore-eos"] if system.ignore_eos else ["--extra-body", json.dumps(system.openai_extra)]
    return [*base, *target, *workload.flags, "--num-prompts", str(num), "--seed", str(seed), *eos, "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename, "--label", system.name]


def run_epd_bench(cmd: list[str], log: Path) -> dict[str, Any]:
    """Run one epd-bench command (its console report goes to `log`); returns its result JSON."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"$ {shlex.join(cmd)}\n".encode())
        out.flush()
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True)
    return dict(json.loads((Path(cmd[cmd.index("--result-dir") + 1]) /
                            cmd[cmd.index("--result-filename") + 1]).read_text()))


def run_one(cmd: list[str], log: Path) -> dict[str, Any]:
    """run_epd_bench; a run that failed as a whole (exit status != 0) as {"error": ...}, so the others go on."""
    try:
        return run_epd_bench(cmd, log)
    except subprocess.CalledProcessError as exc:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        return {"error": f"epd-bench exited {exc.returncode}: {' '.join(tail)[-300:]}"}


def outputs_from_result(result: dict[str, Any], time_offset: float = 0.0) -> list[RequestOutput]:
    """The per-request records of a result JSON as RequestOutputs (start times shifted by time_offset)."""
    n = len(result["successes"])  # turns and cached tokens: absent from results saved before they were recorded
    rows = zip(result["successes"], result["ttfts"], result["itls"], result["e2els"], result["output_lens"],
               result["input_lens"], result["start_times"], result["errors"], result.get("turns", [1] * n),
               result.get("cached_tokens", [0] * n), strict=True)
    return [RequestOutput(success=ok, ttft=ttft, itl=list(itl), latency=e2el, output_tokens=out, prompt_tokens=inp,
                          start_time=start + time_offset, error=err, turn=turn, cached_tokens=cached)
            for ok, ttft, itl, e2el, out, inp, start, err, turn, cached in rows]


def per_request(outputs: list[RequestOutput]) -> dict[str, list[Any]]:
    """A result JSON's per-request lists."""
    return {"input_lens": [o.prompt_tokens for o in outputs], "output_lens": [o.output_tokens for o in outputs],
            "ttfts": [o.ttft for o in outputs], "tpots": [tpot(o) for o in outputs], "itls": [o.itl for o in outputs],
            "e2els": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
            "successes": [o.success for o in outputs], "errors": [o.error for o in outputs],
            "turns": [o.turn for o in outputs], "cached_tokens": [o.cached_tokens for o in outputs]}


def merge_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs of the same workload on the same system, run one after another."""
    outputs: list[RequestOutput] = []
    offset = 0.0
    for part in parts:
        outputs += outputs_from_result(part, offset)
        offset += float(part["duration"])
    metrics = calculate_metrics(outputs, offset, PERCENTILES).to_json()
    return {**metrics, "rounds": len(parts), "num_prompts": len(outputs), **per_request(outputs)}


def merge_rounds(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' results pooled (merge_results); a run that failed as a whole counts as one failed request."""
    runs = [x for x in parts if "successes" in x]
    broken = [x["error"] for x in parts if "successes" not in x]
    if not runs:
        return {"completed": 0, "failed": len(broken), "errors": broken}
    merged = merge_results(runs)
    return {**merged, "failed": merged["failed"] + len(broken), "errors": [*merged["errors"], *broken]}


# around one measured run: (system) -> state before it; (system, state, result) after it
Before = Callable[[SystemSpec], Any]
After = Callable[[SystemSpec, Any, dict[str, Any]], None]


def run_rounds(w: Workload, up: list[Running], rounds: int, run_dir: Path, num: Callable[[SystemSpec], int],
               before: Before | None = None, after: After | None = None,
               prefix: str = "") -> tuple[dict[str, Any], dict[str, str]]:
    """`rounds` epd-bench runs of `w` per system, alternating the order; (system -> pooled result, system -> its
    last command). `before`/`after` run around each measured run (e.g. to read the encoders' /metrics)."""
    parts: dict[str, list[dict[str, Any]]] = {r.spec.name: [] for r in up}
    commands: dict[str, str] = {}
    for rnd in range(rounds):
        for r in up if rnd % 2 == 0 else up[::-1]:
            cmd = epd_bench_cmd(r.spec, w, num(r.spec), w.seed + 100 * rnd, run_dir / "results",
                                f"{prefix or w.name}-{r.spec.name}-{rnd}.json")
            print(f"[{time.strftime('%H:%M:%S')}] {w.name} round {rnd} on {r.spec.name}", flush=True)
            commands[r.spec.name] = shlex.join(cmd)
            state = before(r.spec) if before else None
            parts[r.spec.name].append(result := run_one(cmd, run_dir / "epd-bench.log"))
            if after:
                after(r.spec, state, result)
    return {name: merge_rounds(p) for name, p in parts.items()}, commands


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of `name` in Prometheus text format (None when it has none)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{")]
    return sum(values) if values else None


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `check` until it holds; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout} s")
        time.sleep(0.05)


def scrape(url: str, names: dict[str, str]) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30.0).text
    return {k: metric_sum(text, m) or 0.0 for k, m in names.items()}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def in_window(shorts: list[Timed], longs: list[Timed]) -> dict[str, Any]:
    """What the short streams did while long prompts were in flight (the first one's arrival to the last one's end):
    each gap (s) between two content chunks that ended in it (index 0: a request's first-to-second), the TTFT of each
    request whose first chunk came in it, and content chunks per second."""
    start, end = min(s for s, _ in longs), max(s + o.latency for s, o in longs)
    gaps: list[tuple[int, float]] = []
    ttfts, chunks = [], 0
    for sent, out in (x for x in shorts if x[1].success):
        times = list(accumulate(out.itl, initial=sent + out.ttft))  # perf_counter of each content chunk
        chunks += sum(start <= t <= end for t in times)
        ttfts += [out.ttft] if start <= times[0] <= end else []
        gaps += [(i, g) for i, (g, t) in enumerate(zip(out.itl, times[1:], strict=True)) if start <= t <= end]
    return {"itl_s": [g for _, g in gaps], "itl_running_s": [g for i, g in gaps if i], "short_ttft_s": ttfts,
            "short_chunks_per_s": chunks / (end - start) if end > start else 0.0}
