"""The demo stack at two revisions, side by side in one run: latency of a new image and of a cached image.

    python -m epd_bench.revisions --base 7cfb65e [--n 30] [--json]

`--base` is exported with `git archive` into runs/revisions/<sha> (the git repository is not touched) and run
from there with PYTHONPATH pointing at it; the other stack runs this working tree. Both are `disagg-epd-proxy
--model demo` (2 encoders, 1 decoder, launcher mode, unpinned) started at once. Each round sends, to each stack in
alternating order, one streamed request with an image neither has seen and one with an image both have seen (sent
once during warm-up), and records the time to the first content token and to the end of the stream, through the
whole HTTP path: client -> proxy -> encoder -> connector -> decoder -> proxy -> client.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from epd_bench.pipeline import image_url, summary
from epd_bench.stacks import HOST, ProcSpec, Running, SystemSpec
from epd_launcher.group import free_port

ROOT = Path(__file__).resolve().parent.parent
CACHED_SEED = 999_999  # the image every cached request carries


def export_revision(rev: str, into: Path = ROOT / "runs" / "revisions") -> tuple[str, Path]:
    """(full sha, a directory holding that revision's files), made once per sha with `git archive`."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    tree = into / sha[:12]
    if not (tree / ".complete").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha],
                                 check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        (tree / ".complete").touch()
    return sha, tree


def shipped_path(tree: Path) -> str:
    """PYTHONPATH running the revision in `tree` as it shipped: if its dependencies did not name uvloop, a stub that
    fails to import hides the installed one, so uvicorn's loop="auto" falls back to asyncio's loop there as it did."""
    if "uvloop" in (tree / "pyproject.toml").read_text():
        return str(tree)
    stub = tree.parent / f"{tree.name}-no-uvloop"
    stub.mkdir(exist_ok=True)
    (stub / "uvloop.py").write_text('raise ImportError("uvloop: not a dependency of this revision")\n')
    return f"{stub}{os.pathsep}{tree}"


def demo_stack(name: str, tree: Path) -> SystemSpec:
    """`disagg-epd-proxy --model demo` from the code in `tree` (2 encoders, 1 decoder)."""
    port = free_port()
    argv = (sys.executable, "-m", "epd_launcher.cli", "--model", "demo", "--num-encoders", "2", "--num-decoders",
            "1", "--host", HOST, "--port", str(port), "--log-level", "warning")
    proc = ProcSpec("launcher", argv, None, None, f"http://{HOST}:{port}", env=(("PYTHONPATH", shipped_path(tree)),))
    return SystemSpec(name, (proc,), "demo")


@dataclass
class Timing:
    ttft: float
    total: float


def request(client: httpx.Client, url: str, seed: int) -> Timing:
    """One streamed chat completion with image `seed`: seconds to the first content token and to the end."""
    content = [{"type": "image_url", "image_url": {"url": image_url(seed)}},
               {"type": "text", "text": "What color is the shape?"}]
    body = {"model": "demo", "stream": True, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    start = time.perf_counter()
    first = 0.0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not first and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
    if not first:
        raise RuntimeError(f"{url}: no content token")
    return Timing(first, time.perf_counter() - start)


def wait_ready(client: httpx.Client, url: str, timeout: float) -> None:
    """Until a real request is answered (the launcher is up and its workers are healthy)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            request(client, url, CACHED_SEED)
            return
        except (httpx.HTTPError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def measure(stacks: dict[str, str], n: int) -> dict[str, Any]:
    """Interleaved rounds; per stack, the TTFT and total latency summaries of new and cached images."""
    names = list(stacks)
    times: dict[str, dict[str, list[Timing]]] = {s: {"new": [], "cached": []} for s in names}
    with httpx.Client(timeout=120) as client:
        for name in names:
            wait_ready(client, stacks[name], 300)
            for seed in range(3):  # warm-up: lazy imports, connections, first encodes
                request(client, stacks[name], 50_000 + seed)
        for i in range(n):
            for name in names if i % 2 else names[::-1]:
                times[name]["new"].append(request(client, stacks[name], i))
                times[name]["cached"].append(request(client, stacks[name], CACHED_SEED))
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {kind: {"ttft": summary([t.ttft for t in ts]), "total": summary([t.total for t in ts])}
                     for kind, ts in times[name].items()}
    return out


def ratios(result: dict[str, Any], after: str, before: str) -> dict[str, float]:
    """after ÷ before of the p50s (below 1: the new code is faster)."""
    return {f"{kind}_{metric}_p50_after_vs_before": round(result[after][kind][metric]["p50_ms"]
                                                          / result[before][kind][metric]["p50_ms"], 3)
            for kind in ("new", "cached") for metric in ("ttft", "total")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the revision to compare this working tree with (a git rev)")
    p.add_argument("--n", type=int, default=30, help="rounds (each: one new and one cached image per stack)")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args(argv)
    sha, tree = export_revision(args.base)
    specs = [demo_stack("before", tree), demo_stack("after", ROOT)]
    log_dir = ROOT / "runs" / "revisions" / "logs"
    running = []
    try:
        for spec in specs:
            running.append(Running(spec, log_dir))
        result: dict[str, Any] = {"base": sha, "n": args.n, **measure({s.name: s.url for s in specs}, args.n)}
    finally:
        for r in running:
            r.stop()
    result["ratios"] = ratios(result, "after", "before")
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
