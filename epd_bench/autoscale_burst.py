"""A burst of image requests on the demo, with --autoscale and on the fixed fleet, one after the other in one run:
python -m epd_bench.autoscale_burst

Each stack is the launcher with one encoder and one decoder (the autoscaled one may add a second encoder). For
`--burst-s` seconds, `--concurrency` clients each send request after request, every one with `--images` new
images, streaming, and the time to first token of each is kept with when it started. Then the load stops and the
autoscaled stack is watched until it is back to one encoder. Reported per stack: TTFT (mean, p50, p90) of the
requests that started in the burst's first and last thirds, when the second encoder came (and the TTFT after it),
how long the drain took, failed requests (none expected), and the machine's busy share over the burst (/proc/stat:
a second encoder can only help where there are cores to spare).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from epd_builders.shapes import draw_shape
from epd_launcher.group import free_port

KEY = "autoscale-burst-key"


def _launch(port: int, autoscale: bool, window: float, log: Path) -> subprocess.Popen[bytes]:
    extra = ["--autoscale", "--autoscale-window", str(window), "--max-encoders", "2"] if autoscale else []
    cmd = [sys.executable, "-m", "epd_launcher.cli", "--model", "demo", "--port", str(port), "--num-encoders", "1",
           "--num-decoders", "1", "--internal-key", KEY, *extra]
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


def _encoders(base: str) -> int:
    try:
        info = httpx.get(f"{base}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        return len(info.get("encoders", []))
    except (httpx.HTTPError, ValueError):
        return -1


_BASES = [draw_shape(colour, "circle", random.Random(i), size=256) for i, colour in enumerate(("red", "blue", "green"))]


def _png(seed: int) -> bytes:
    """A new 256 x 256 picture per seed (one pixel set from it), stored uncompressed: cheap to make, so the client
    does not compete with the encoder for the CPU, and a full decode for the encoder."""
    image = _BASES[seed % len(_BASES)].copy()
    image.putpixel((seed % 256, (seed // 256) % 256), (seed % 251, seed % 241, seed % 239))
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=0)
    return buf.getvalue()


def _ttft(base: str, seed: int, images: int) -> float | None:
    """One streamed request with `images` new images: seconds to its first content chunk (None: it failed)."""
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        _png(seed * 16 + i)).decode()}} for i in range(images)]
    body = {"model": "demo", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Colours?"}]}]}
    start = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            return None
        first = None
        for line in resp.iter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - start
        return first


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine so far (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _summary(ttfts: list[float]) -> dict[str, float | int]:
    if not ttfts:
        return {"n": 0}
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else [ttfts[0]] * 9
    return {"n": len(ttfts), "mean": statistics.fmean(ttfts), "p50": statistics.median(ttfts), "p90": q[8]}


def run(autoscale: bool, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _launch(port, autoscale, args.window, log_dir / f"{'autoscale' if autoscale else 'fixed'}.log")
    try:
        deadline = time.monotonic() + 300
        while _encoders(base) < 1:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the stack did not start: see {log_dir}")
            time.sleep(0.5)
        t0, stop, lock = time.monotonic(), threading.Event(), threading.Lock()
        cpu0 = _cpu_times()
        seeds = iter(range(10 ** 9))
        done: list[tuple[float, float | None]] = []  # (start offset, ttft or None)
        grew: list[float] = []

        def client() -> None:
            while not stop.is_set():
                with lock:
                    seed = next(seeds)
                at = time.monotonic() - t0
                ttft = _ttft(base, seed, args.images)
                with lock:
                    done.append((at, ttft))

        with ThreadPoolExecutor(args.concurrency) as pool:
            futures = [pool.submit(client) for _ in range(args.concurrency)]
            while time.monotonic() - t0 < args.burst_s:
                if not grew and _encoders(base) == 2:
                    grew.append(time.monotonic() - t0)
                time.sleep(0.5)
            stop.set()
            for f in futures:
                f.result()
        cpu1 = _cpu_times()
        burst_end, drained = time.monotonic() - t0, None
        while autoscale and time.monotonic() - t0 < burst_end + args.drain_s:
            if _encoders(base) == 1:
                drained = time.monotonic() - t0 - burst_end
                break
            time.sleep(0.5)
        third = args.burst_s / 3
        ok = [(at, t) for at, t in done if t is not None]
        return {"autoscale": autoscale, "requests": len(done), "failed": len(done) - len(ok), "cores": os.cpu_count(),
                "machine_busy_share": (cpu1[0] - cpu0[0]) / max(1.0, cpu1[1] - cpu0[1]),
                "second_encoder_at_s": grew[0] if grew else None, "drained_after_s": drained,
                "ttft_first_third": _summary([t for at, t in ok if at < third]),
                "ttft_last_third": _summary([t for at, t in ok if at >= 2 * third]),
                "ttft_after_second_encoder": _summary([t for at, t in ok if grew and at >= grew[0]])}
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epd_bench.autoscale_burst", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--burst-s", type=float, default=90.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--images", type=int, default=8, help="new images per request")
    p.add_argument("--window", type=float, default=5.0, help="--autoscale-window of the autoscaled stack")
    p.add_argument("--drain-s", type=float, default=120.0, help="how long to wait for the drain")
    p.add_argument("--out", default="runs/autoscale_burst")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run(autoscale, args, out) for autoscale in (False, True)]
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    for r in results:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
