"""What the micro-benchmarks share: their command line, timing a callable, and the local processes they start."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def parser(module: str, doc: str | None, json_help: str | None = "print the result as JSON") -> argparse.ArgumentParser:
    """`python -m epd_bench.<module>`'s parser: the docstring as its help, no abbreviated flags, and --json."""
    p = argparse.ArgumentParser(f"python -m epd_bench.{module}", description=doc, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if json_help:
        p.add_argument("--json", action="store_true", help=json_help)
    return p


def emit(result: Any, as_json: bool, text: Callable[[Any], str] | None = None, indent: int | None = None) -> None:
    """Print the result: JSON (with --json, or when there is no text form), else its text form."""
    print(json.dumps(result, indent=indent) if as_json or text is None else text(result), flush=True)


def median_s(fn: Callable[[], object], repeats: int = 5, budget_s: float = 0.0, max_reps: int = 2000,
             warmup: int = 1) -> float:
    """Median seconds of fn() after `warmup` calls: `repeats` calls, more while within budget_s (up to max_reps)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < budget_s and len(times) < max_reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], None]], iters: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each function, run in turn (the order flipped every round) so noise hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(iters):
        for name in names if i % 2 == 0 else reversed(names):
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def summary(seconds: list[float], nbytes: int) -> dict[str, Any]:
    """p50/p99/mean in ms and the p50's throughput (GB = 1e9 bytes)."""
    p50 = statistics.median(seconds)  # p99 interpolated between ranks, as numpy.percentile
    p99 = statistics.quantiles(seconds, n=100, method="inclusive")[98] if len(seconds) > 1 else seconds[0]
    return {"iters": len(seconds), "p50_ms": round(p50 * 1e3, 4), "p99_ms": round(p99 * 1e3, 4),
            "mean_ms": round(statistics.fmean(seconds) * 1e3, 4), "throughput_gbps": round(nbytes / p50 / 1e9, 3)}


def check(ok: bool, message: str) -> None:
    """Raise unless `ok` (an assert that survives python -O)."""
    if not ok:
        raise RuntimeError(message)


def sync(device: Any) -> None:
    """Wait for the device's queued work (CUDA), so a timer around it measures the work."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def spawn(args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
          pythonpath: str | Path | None = None) -> subprocess.Popen[bytes]:
    """`python ARGS` in the background, its output discarded."""
    env = {**os.environ, **(env or {}), **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0,
              ready: Callable[[int], bool] = lambda status: status == 200) -> None:
    """Until GET url answers a status `ready` accepts; RuntimeError if the process exits, TimeoutError past timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready(httpx.get(url, timeout=1.0).status_code):
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process {proc.args!r} exited ({proc.returncode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout} s")
        time.sleep(0.02)


def stop(proc: subprocess.Popen[Any], grace: float = 30.0) -> None:
    """SIGTERM, then SIGKILL past `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def served(args: list[str], url: str, timeout: float = 60.0, ready: Callable[[int], bool] = lambda s: s == 200, *,
           env: dict[str, str] | None = None, cwd: str | Path | None = None,
           pythonpath: str | Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`python ARGS` (see spawn) started, ready at GET url, and stopped when the block ends."""
    proc = spawn(args, env, cwd, pythonpath)
    try:
        wait_http(url, proc, timeout, ready)
        yield proc
    finally:
        stop(proc)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its live children (a proxy's spawned processes)."""
    kids = [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    total = cpu_seconds(pid)
    for kid in kids:
        try:
            total += cpu_seconds(kid)
        except FileNotFoundError:  # exited since it was listed
            pass
    return total


def status_kib(field: str, pid: int | str = "self") -> int:
    """A kB field of /proc/PID/status (VmRSS, VmHWM)."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def decoder_engine(lm: Any, cfg: Any, **consumer_kw: Any) -> Any:
    """A decoder Engine in this process on its own tensor consumer (engine.consumer) and metrics registry."""
    from prometheus_client import CollectorRegistry  # heavy imports here, so each benchmark's --help stays light

    from connector.tensors.consumer import ECConsumer
    from decoder_service.metrics import DecoderMetrics
    from decoder_service.shell import Engine

    consumer = ECConsumer(**consumer_kw)
    return Engine(lm, consumer, cfg, DecoderMetrics(CollectorRegistry(), consumer.stats))
