"""TTFT with and without pipelined encode, side by side in one run.

    python -m epd_bench.pipeline [--model demo] [--n 40] [--json]

Starts one encoder and one decoder, then two proxies in front of them: one plain (encode, wait, then send
the decode request) and one with --pipeline-encode (send the decode request as soon as the encodes are
scheduled; the decoder's gather waits at the encoder until the embedding is stored). Each round sends one
streaming request with a new image to each proxy, in alternating order, and records the time to the first
content token.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import random
import statistics
import time
from typing import Any

import httpx

from epd_builders.shapes import draw_shape
from epd_launcher.group import WorkerGroup
from epd_models.resolve import resolve_model

HOST = "127.0.0.1"


def image_url(seed: int) -> str:
    buf = io.BytesIO()
    draw_shape("red", "circle", random.Random(seed)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ttft(client: httpx.Client, proxy: str, seed: int) -> float:
    """Seconds from sending a streaming request with a new image to its first content chunk."""
    content = [{"type": "image_url", "image_url": {"url": image_url(seed)}},
               {"type": "text", "text": "What color is the shape?"}]
    body = {"model": "demo", "stream": True, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    start = time.perf_counter()
    first = 0.0
    with client.stream("POST", f"{proxy}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not first and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
    assert first, "no content token"
    return first


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": round(statistics.median(ordered) * 1e3, 2),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 2),
            "mean_ms": round(statistics.fmean(ordered) * 1e3, 2)}


def run(plain: str, pipelined: str, n: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"plain": [], "pipelined": []}
    with httpx.Client(timeout=120) as client:
        for seed in range(4):  # warm-up: first requests pay for lazy imports and connections
            ttft(client, plain, 10_000 + seed)
            ttft(client, pipelined, 20_000 + seed)
        for i in range(n):
            order = [("plain", plain), ("pipelined", pipelined)]
            for name, url in order if i % 2 else order[::-1]:
                times[name].append(ttft(client, url, 2 * i + (name == "pipelined")))
    plain_s, piped_s = summary(times["plain"]), summary(times["pipelined"])
    return {"n": n, "plain": plain_s, "pipelined": piped_s,
            "ttft_p50_ratio_pipelined_vs_plain": round(piped_s["p50_ms"] / plain_s["p50_ms"], 3),
            "ttft_p50_saved_ms": round(plain_s["p50_ms"] - piped_s["p50_ms"], 2)}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--n", type=int, default=40, help="requests per proxy")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args()
    model = str(resolve_model(args.model))
    group = WorkerGroup()
    quiet = ["--log-level", "warning"]
    try:
        enc, dec = (group.spawn(role, model, HOST, 1, quiet) for role in ("encoder", "decoder"))
        group.wait_healthy(300)
        urls = ["--encode-servers-urls", enc.url, "--decode-servers-urls", dec.url, *quiet]
        plain = group.spawn("proxy", "demo", HOST, 1, urls)
        piped = group.spawn("proxy", "demo", HOST, 1, ["--pipeline-encode", *urls])
        group.wait_healthy(300)
        result = {"model": args.model, **run(plain.url, piped.url, args.n)}
    finally:
        group.stop()
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
