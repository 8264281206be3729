"""`python -m epd_bench.proxy --json`: what the proxy adds, in front of a fake decoder that answers instantly, beside
a pass-through proxy with no logic (the practical limit; both servers: epd_bench/proxy_servers.py) and, with `--baseline-rev`, the proxy at another revision (its files by `git archive`), in one run.

Requests: streamed text-only chat completions with a small realistic body (an image would add encoder work that is
not the proxy's). Latency: sequential requests, the targets interleaved request by request, time to the first
streamed bytes; `overhead_ms_p50` is the proxy's p50 minus the decoder's own (POST /generate directly). Throughput:
`--clients` concurrent clients for `--seconds` per target (targets interleaved over `--rounds`); `rps_per_core` is
completed requests per CPU second of the proxy process (user + system, from /proc; with several proxy processes, of
all of them), so it does not depend on how many cores the machine lends it. `epd_2proc` is the proxy with
`--proxy-workers 2`; `scaling_2_vs_1` is its requests/s (wall) over the one-process proxy's, the same clients
loading both (on a machine whose cores the load generator shares, it stays below 2). The load generator's own CPU seconds are reported beside it (`client_cpu_s`): if
they approach the wall time, the client, not the proxy, is the limit."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx

from epd_bench.micro import HOST, emit, parser, served, tree_cpu_seconds
from epd_launcher.group import free_port

MESSAGES = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": "What is the capital of France, and what river runs through it?"}]
CHAT = {"model": "demo", "stream": True, "max_tokens": 64, "temperature": 0.0, "messages": MESSAGES}
GENERATE = {"messages": MESSAGES}
INTERNAL_KEY = "bench-proxy-internal-key"  # the proxy's /health names its pid only to a caller with the internal key
INTERNAL = {"Authorization": f"Bearer {INTERNAL_KEY}"}
TRACE_RATIOS = (0.01, 1.0)  # --tracing


@dataclass
class Target:
    name: str
    url: str
    path: str
    body: bytes
    proc: subprocess.Popen[bytes] | None = None  # the process whose CPU time counts (None: the fake decoder's)


def wait_procs(url: str, num_procs: int, timeout: float = 60.0) -> None:
    """Until `num_procs` processes answer /health (its `pid`) over fresh connections: all of them take load."""
    pids: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(pids) < num_procs:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: {len(pids)} of {num_procs} proxy processes serve after {timeout}s")
        pids.add(httpx.get(f"{url}/health", headers={"Connection": "close", **INTERNAL}, timeout=2.0).json()["pid"])


def traced_args(decoder_url: str, endpoint: str, ratio: float, port: int) -> list[str]:
    return [*proxy_args(decoder_url, port), "--otlp-traces-endpoint", endpoint, "--otlp-traces-sample-ratio", str(ratio)]


def proxy_args(decoder_url: str, port: int, num_procs: int = 1) -> list[str]:
    """The proxy's command line (`--proxy-workers` only when > 1: a base revision may not know the flag)."""
    more = ["--proxy-workers", str(num_procs)] if num_procs > 1 else []
    return ["-m", "epd_launcher.cli", "--aggregated", "--decode-servers-urls", decoder_url, "--port", str(port),
            "--log-level", "warning", "--insecure", *more]


async def first_bytes(client: httpx.AsyncClient, t: Target) -> float:
    """Seconds from sending one request to its first streamed bytes (the rest is read, not timed)."""
    start = time.perf_counter()
    async with client.stream("POST", t.url + t.path, content=t.body,
                             headers={"content-type": "application/json"}) as resp:
        first = None
        async for _ in resp.aiter_raw():
            first = first or time.perf_counter()
        if resp.status_code != 200:
            raise RuntimeError(f"{t.name}: answered {resp.status_code}")
    return (first or time.perf_counter()) - start


async def latency(targets: list[Target], n: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    async with httpx.AsyncClient(timeout=30.0) as client:
        for t in targets:  # warm up: connections, first-call imports
            for _ in range(20):
                await first_bytes(client, t)
        for _ in range(n):
            for t in targets:
                samples[t.name].append(await first_bytes(client, t))
    return {name: statistics.median(s) * 1000 for name, s in samples.items()}


async def load(t: Target, clients: int, seconds: float) -> tuple[int, float, float, float]:
    """(completed requests, wall s, proxy CPU s, client CPU s) for `clients` concurrent loops for `seconds`."""
    done = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        stop = time.perf_counter() + seconds

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await first_bytes(client, t)
                done += 1

        cpu0, own0, wall0 = tree_cpu_seconds(t.proc.pid) if t.proc else 0.0, time.process_time(), time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        wall = time.perf_counter() - wall0
        cpu = (tree_cpu_seconds(t.proc.pid) if t.proc else 0.0) - cpu0
    return done, wall, cpu, time.process_time() - own0


async def throughput(targets: list[Target], clients: int, seconds: float, rounds: int) -> dict[str, dict[str, float]]:
    totals = {t.name: [0, 0.0, 0.0, 0.0] for t in targets}
    for _ in range(rounds):
        for t in targets:
            for i, v in enumerate(await load(t, clients, seconds)):
                totals[t.name][i] += v
    out = {}
    for name, (done, wall, cpu, own) in totals.items():
        out[name] = {"requests": done, "rps": done / wall, "proxy_cpu_s": cpu, "client_cpu_s": own, "wall_s": wall,
                     "rps_per_core": done / cpu if cpu else float("nan")}
    return out


def run(args: argparse.Namespace) -> dict[str, object]:
    with ExitStack() as stack:
        env = {"EPD_INTERNAL_KEY": INTERNAL_KEY}  # the fake decoder takes any key

        def start(args: list[str], port: int, cwd: str | None = None,
                  pythonpath: str | None = None) -> tuple[str, subprocess.Popen[bytes]]:
            url = f"http://{HOST}:{port}"  # the pass-through answers /health 404: any answer but an error is ready
            return url, stack.enter_context(served(args, f"{url}/health", ready=lambda s: s < 500, env=env, cwd=cwd,
                                                   pythonpath=pythonpath))

        decoder_url, _ = start(["-m", "epd_bench.proxy_servers", "fake-decoder", "--port", str(port := free_port())],
                               port)
        chat = json.dumps(CHAT).encode()
        targets = [Target("direct", decoder_url, "/generate", json.dumps(GENERATE).encode())]

        def target(name: str, argv: Callable[[int], list[str]], cwd: str | None = None,
                   pythonpath: str | None = None) -> None:
            url, proc = start(argv(port := free_port()), port, cwd, pythonpath)
            targets.append(Target(name, url, "/v1/chat/completions", chat, proc))

        target("passthrough", lambda p: ["-m", "epd_bench.proxy_servers", "passthrough", "--decoder-url",
                                         decoder_url, "--port", str(p)])
        target("proxy", lambda p: proxy_args(decoder_url, p))
        target("epd_2proc", lambda p: proxy_args(decoder_url, p, 2))
        wait_procs(targets[-1].url, 2)
        if args.baseline_rev:  # a read-only copy of the revision's files (git archive; the repository is untouched)
            from epd_bench.revisions import export_revision, shipped_path  # heavy: not for --help

            tree = export_revision(args.baseline_rev)[1]
            target("baseline", lambda p: proxy_args(decoder_url, p), cwd=str(tree), pythonpath=shipped_path(tree))
        if args.tracing:  # the proxy exporting to a sink (epd_bench.otlp_sink), at ratio 0.01 and 1.0
            sink_url, _ = start(["-m", "epd_bench.otlp_sink", "--port", str(port := free_port())], port)
            for ratio in TRACE_RATIOS:
                target(f"traced_{ratio:g}", partial(traced_args, decoder_url, f"{sink_url}/v1/traces", ratio))
        p50 = asyncio.run(latency(targets, args.requests))
        tput = asyncio.run(throughput(targets[1:], args.clients, args.seconds, args.rounds))
    result: dict[str, object] = {
        "requests": "streamed text-only chat completions", "ttft_ms_p50": p50,
        "overhead_ms_p50": p50["proxy"] - p50["direct"],
        "passthrough_overhead_ms_p50": p50["passthrough"] - p50["direct"],
        "rps_per_core": tput["proxy"]["rps_per_core"],
        "ratio_vs_passthrough": tput["proxy"]["rps_per_core"] / tput["passthrough"]["rps_per_core"],
        "throughput": tput, "rps_per_core_2proc": tput["epd_2proc"]["rps_per_core"],
        # requests/s (wall) of the proxy with --proxy-workers 2 over the one-process proxy, same clients
        "scaling_2_vs_1": tput["epd_2proc"]["rps"] / tput["proxy"]["rps"], "cpu_count": os.cpu_count(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    if "baseline" in tput:
        result["baseline_rev"] = args.baseline_rev
        result["overhead_ms_p50_baseline"] = p50["baseline"] - p50["direct"]
        result["ratio_rps_per_core_vs_baseline"] = tput["proxy"]["rps_per_core"] / tput["baseline"]["rps_per_core"]
    if args.tracing:  # tracing off is `proxy`; absent is `baseline` at a revision before tracing (--baseline-rev)
        result["tracing"] = {f"traced_{r:g}": {"overhead_ms_p50": p50[f"traced_{r:g}"] - p50["direct"],
                                               "rps_per_core_vs_off": tput[f"traced_{r:g}"]["rps_per_core"]
                                               / tput["proxy"]["rps_per_core"]} for r in TRACE_RATIOS}
    return result


def main(argv: list[str] | None = None) -> None:
    p = parser("proxy", __doc__)
    p.add_argument("--baseline-rev", help="also measure the proxy at this git revision (its files by git archive)")
    p.add_argument("--requests", type=int, default=300, help="sequential requests per target for latency")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients for throughput")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds of load per target and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the targets for throughput")
    p.add_argument("--tracing", action="store_true",
                   help="also the proxy exporting traces (ratio 0.01 and 1.0) to a sink; with --baseline-rev at a "
                        "revision before tracing, `ratio_rps_per_core_vs_baseline` is tracing off against absent")
    args = p.parse_args(argv)
    emit(run(args), True, indent=None if args.json else 2)


if __name__ == "__main__":
    main()
