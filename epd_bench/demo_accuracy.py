"""Demo-model accuracy through the whole EPD path (proxy -> encoders -> ZeroMQ -> decoder) over HTTP.

    python -m epd_bench.demo_accuracy [--base-url URL] [--n 200] [--json]

Without --base-url it launches `disagg-epd-proxy --model demo --num-encoders 2 --num-decoders 1` on a
free port, runs, and stops it. Images are drawn with the held-out seed of `epd_builders.demo_train.evaluate`.
"""
from __future__ import annotations

import base64
import io
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from epd_bench.micro import HOST, emit, parser, served
from epd_launcher.group import free_port
from epd_models.demo import EVAL_SEED


@contextmanager
def launched_demo(num_encoders: int = 2) -> Iterator[str]:
    """`disagg-epd-proxy --model demo` on a free port until the block ends; its URL."""
    url = f"http://{HOST}:{(port := free_port())}"
    with served(["-m", "epd_launcher.cli", "--model", "demo", "--num-encoders", str(num_encoders), "--num-decoders",
                 "1", "--port", str(port), "--log-level", "warning"], f"{url}/health", timeout=300):
        yield url


def ask(client: httpx.Client, url: str, image_png: bytes, question: str) -> tuple[str, float]:
    data = "data:image/png;base64," + base64.b64encode(image_png).decode()
    body = {"model": "demo", "temperature": 0, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data}}, {"type": "text", "text": question}]}]}
    start = time.perf_counter()
    resp = client.post(f"{url}/v1/chat/completions", json=body)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"].strip(), time.perf_counter() - start


def run(url: str, n: int) -> dict[str, object]:
    from epd_builders.shapes import draw_shape  # imports transformers: not for --help
    from epd_builders.tokenizer import COLORS, QUESTIONS, SHAPES

    rng, hits = random.Random(EVAL_SEED), {"color": 0, "shape": 0}
    latency: dict[str, list[float]] = {"color": [], "shape": []}
    with httpx.Client(timeout=120) as client:
        for _ in range(n):
            color, shape = rng.choice(COLORS), rng.choice(SHAPES)
            buf = io.BytesIO()
            draw_shape(color, shape, rng).save(buf, format="PNG")
            for kind, truth in (("color", color), ("shape", shape)):
                answer, seconds = ask(client, url, buf.getvalue(), QUESTIONS[kind])
                hits[kind] += answer == truth
                latency[kind].append(seconds)
    return {
        "n": n, "seed": EVAL_SEED, "color_acc": hits["color"] / n, "shape_acc": hits["shape"] / n,
        # first question of an image encodes it; the second finds it cached
        "median_latency_s_new_image": round(statistics.median(latency["color"]), 4),
        "median_latency_s_cached_image": round(statistics.median(latency["shape"]), 4),
    }


def main(argv: list[str] | None = None) -> None:
    p = parser("demo_accuracy", __doc__, "print only the JSON result")
    p.add_argument("--base-url", help="a running server (default: launch one)")
    p.add_argument("--n", type=int, default=200)
    args = p.parse_args(argv)
    if args.base_url:
        result = run(args.base_url.rstrip("/").removesuffix("/v1"), args.n)
    else:
        with launched_demo() as url:
            result = run(url, args.n)
    emit(result, True, indent=None if args.json else 2)


if __name__ == "__main__":
    main()
