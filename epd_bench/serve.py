"""epd-bench: load-test any OpenAI-compatible server with a random multimodal workload.

    epd-bench --base-url http://127.0.0.1:8000 --num-prompts 50 \\
              --images-per-request 2 --repeat-ratio 0.5 --request-rate 2 --save-result
    epd-bench --base-url ... --dataset multi-turn --conversations 8 --turns 4 --max-concurrency 4
    epd-bench --base-url ... --dataset shared-prefix --system-prompt-len 300 --max-concurrency 4
    epd-bench --base-url ... --images-per-request 0 --videos-per-request 1 --video-frames 32 --max-concurrency 1
    epd-bench --base-url ... --images-per-request 0 --audios-per-request 1 --audio-seconds 120 --max-concurrency 1

Datasets: `random` (independent prompts, images optionally repeated), `multi-turn` (conversations that
resend their history with the server's answers, interleaved up to --max-concurrency; see
epd_bench/conversations.py) and `shared-prefix` (`random` where every request starts with the same
system message of --system-prompt-len words; no images unless asked). Any of them can carry videos
(--videos-per-request: short clips made with PyAV, --video-frames each, all of them asked for) and audio
(--audios-per-request: 16 kHz mono WAV tones of --audio-seconds each, sent as `input_audio` parts).

Flags follow `vllm bench serve` where the same thing exists. Requests are sent at Poisson times
(`--request-rate`, gamma-distributed gaps with `--burstiness` != 1; `inf`: all at once), optionally
capped at `--max-concurrency` in flight. Reports request and output-token throughput, goodput under
`--goodput` SLOs, and TTFT / TPOT / ITL / end-to-end latency statistics, and each failure's reason;
`--save-result` writes them with every request's timings as JSON (under runs/epd-bench/ unless --result-dir),
`--plot DIR` draws them (needs matplotlib: the `bench` extra). --model defaults to the first model the server
lists at /v1/models; a --model it does not list is refused before any request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from epd_bench.backends import BACKENDS, RequestInput, RequestOutput
from epd_bench.bench_flags import parse_args
from epd_bench.conversations import MultiTurnSpec, build_conversations, run_conversations
from epd_bench.dataset import DatasetSpec, SampleRequest, build_dataset, repeat_share
from epd_bench.metrics import (
    BenchmarkMetrics,
    calculate_metrics,
    format_report,
    tpot,
)


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then gamma gaps with mean 1/rate.

    burstiness 1 gives a Poisson process; lower is burstier, higher more regular. rate inf: all at 0.
    """
    if num <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def _base_url(args: argparse.Namespace) -> str:
    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url  # accept the OpenAI SDK's base_url too


async def _served_models(client: httpx.AsyncClient, url: str, api_key: str | None) -> list[str]:
    """The models the server lists at GET /v1/models ([] when it lists none or has no such route)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.get(f"{url}/v1/models", headers=headers)
        return [str(m["id"]) for m in resp.json()["data"]] if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []


async def _pick_model(client: httpx.AsyncClient, url: str, args: argparse.Namespace) -> str | None:
    """--model, else the first model the server lists (as vLLM's client does); SystemExit (2) naming the served
    models when --model is not one of them, before any request is sent."""
    if args.backend != "openai-chat":
        return str(args.model) if args.model else None
    served = await _served_models(client, url, args.api_key)
    if args.model is None:
        if not served:
            raise SystemExit(f"epd-bench: error: {url}/v1/models lists no model; pass --model")
        return served[0]
    if served and args.model not in served:
        raise SystemExit(f"epd-bench: error: --model {args.model!r} is not served at {url}; it serves: "
                         f"{', '.join(served)} (leave --model out to use the first)")
    return str(args.model)


async def _send_all(client: httpx.AsyncClient, inputs: list[RequestInput], offsets: list[float],
                    args: argparse.Namespace) -> tuple[list[RequestOutput], float]:
    """Send each request at its offset (waiting for a slot under --max-concurrency); returns outputs, duration."""
    func = BACKENDS[args.backend]
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(inputs), disable=args.disable_tqdm, file=sys.stderr, desc="requests")
    start = time.perf_counter()

    async def one(inp: RequestInput, offset: float) -> RequestOutput:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if limit is not None:
            await limit.acquire()
        try:
            sent = time.perf_counter() - start
            out: RequestOutput = await func(client, inp)
            out.start_time = sent
        finally:
            if limit is not None:
                limit.release()
        bar.update(1)
        return out

    try:
        outputs = await asyncio.gather(*(one(inp, off) for inp, off in zip(inputs, offsets, strict=True)))
    finally:
        bar.close()
    return list(outputs), time.perf_counter() - start


async def _warm_up(client: httpx.AsyncClient, inputs: list[RequestInput], backend: str) -> None:
    for inp in inputs:
        out: RequestOutput = await BACKENDS[backend](client, inp)
        if not out.success:
            raise RuntimeError(f"warm-up request failed: {out.error}")


async def benchmark(args: argparse.Namespace) -> tuple[dict[str, Any], BenchmarkMetrics]:
    """Run the whole benchmark described by parsed flags; returns the result JSON and its metrics."""
    spec = dataset_spec(args)
    url = _base_url(args)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = await _pick_model(client, url, args)

        def request(s: SampleRequest, history: tuple[dict[str, Any], ...] = ()) -> RequestInput:
            return RequestInput(url=url, model=model or "", sample=s, ignore_eos=args.ignore_eos,
                                temperature=args.temperature, api_key=args.api_key, extra_body=args.extra_body,
                                history=history)

        if isinstance(spec, MultiTurnSpec):
            outputs, duration, samples = await _run_multi_turn(client, spec, request, args)
        else:
            warm, samples = build_dataset(spec, args.num_warmups)
            await _warm_up(client, [request(s) for s in warm], args.backend)
            offsets = arrival_offsets(len(samples), args.request_rate, args.burstiness, args.seed)
            outputs, duration = await _send_all(client, [request(s) for s in samples], offsets, args)
    metrics = calculate_metrics(outputs, duration, args.metric_percentiles, args.goodput, args.percentile_metrics)
    return _result(args, url, model, spec, samples, outputs, metrics.to_json()), metrics


async def _run_multi_turn(client: httpx.AsyncClient, spec: MultiTurnSpec,
                          request: Callable[[SampleRequest, tuple[dict[str, Any], ...]], RequestInput],
                          args: argparse.Namespace) -> tuple[list[RequestOutput], float, list[SampleRequest]]:
    """Warm up with one-turn conversations, then run the conversations; conversations start at the arrival times."""
    warm, conversations = build_conversations(spec, args.num_warmups)
    await _warm_up(client, [request(c.turns[0], ()) for c in warm], args.backend)
    func = BACKENDS[args.backend]
    bar = tqdm(total=spec.conversations * spec.turns, disable=args.disable_tqdm, file=sys.stderr, desc="turns")

    async def send(sample: SampleRequest, history: tuple[dict[str, Any], ...]) -> RequestOutput:
        out: RequestOutput = await func(client, request(sample, history))
        return out

    offsets = arrival_offsets(len(conversations), args.request_rate, args.burstiness, args.seed)
    try:
        outputs, duration = await run_conversations(conversations, offsets, args.max_concurrency, send,
                                                    on_done=lambda: bar.update(1))
    finally:
        bar.close()
    return outputs, duration, [s for c in conversations for s in c.turns]


def dataset_spec(args: argparse.Namespace) -> DatasetSpec | MultiTurnSpec:
    width, height = args.image_size
    spec = DatasetSpec(num_prompts=args.num_prompts, input_len=args.random_input_len,
                       output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                       images_per_request=args.images_per_request, image_width=width, image_height=height,
                       repeat_ratio=args.repeat_ratio, image_format=args.image_format, seed=args.seed,
                       system_prompt_len=args.system_prompt_len, videos_per_request=args.videos_per_request,
                       video_frames=args.video_frames, video_width=args.video_size[0],
                       video_height=args.video_size[1], video_fps=args.video_fps,
                       audios_per_request=args.audios_per_request, audio_seconds=args.audio_seconds)
    if args.dataset == "multi-turn":
        return MultiTurnSpec(spec, args.conversations, args.turns)
    return spec


def _result(args: argparse.Namespace, url: str, model: str | None, spec: DatasetSpec | MultiTurnSpec,
            samples: list[SampleRequest], outputs: list[RequestOutput], metrics: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "base_url": url,
        "model_id": model, "label": args.label, "num_prompts": len(samples),
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "num_warmups": args.num_warmups,
        "dataset_name": args.dataset, "dataset": spec.to_json() if isinstance(spec, MultiTurnSpec) else spec.__dict__,
        "repeat_share": repeat_share(samples), "goodput_slos_ms": args.goodput,
        **metrics,
        "input_lens": [o.prompt_tokens for o in outputs], "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs], "tpots": [tpot(o) for o in outputs], "itls": [o.itl for o in outputs],
        "e2els": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
        "successes": [o.success for o in outputs], "errors": [o.error for o in outputs],
        "turns": [o.turn for o in outputs], "cached_tokens": [o.cached_tokens for o in outputs],
    }
    if args.save_detailed:
        result["generated_texts"] = [o.generated_text for o in outputs]
    return result


def save_result(result: dict[str, Any], args: argparse.Namespace) -> Path:
    name = args.result_filename
    if not name:
        rate = result["request_rate"]
        model = os.path.basename(str(result["model_id"] or "decoder").rstrip("/"))
        name = f"{args.label + '-' if args.label else ''}{args.backend}-{rate}qps-{model}-{result['date']}.json"
    path = Path(args.result_dir or "runs/epd-bench") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def write_plots(result: dict[str, Any], out_dir: Path, label: str) -> list[Path]:
    from epd_bench.plot import plot_latency_cdfs, plot_ttft_over_time  # NOTE: matplotlib only when asked

    runs = {label: result}
    return [plot_latency_cdfs(runs, out_dir / "latency_cdf.png"), plot_ttft_over_time(runs, out_dir / "ttft_over_time.png")]


def failure_lines(outputs_errors: list[str], total: int) -> list[str]:
    """What the terminal says when requests failed: how many, each distinct reason with its count, the first first."""
    errors = [e for e in outputs_errors if e]
    if not errors:
        return []
    counts: dict[str, int] = {}
    for e in errors:
        counts[e[:300]] = counts.get(e[:300], 0) + 1
    return [f"{len(errors)} of {total} requests failed; reasons (count: first error body):",
            *(f"  {n}: {e}" for e, n in counts.items())][:6]


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse, benchmark, print the report, save and plot as asked; returns the result JSON."""
    args = parse_args(argv, __doc__)
    result, metrics = asyncio.run(benchmark(args))
    print(format_report(metrics))
    for line in failure_lines(result["errors"], len(result["errors"])):
        print(line, file=sys.stderr)
    if args.save_result:
        print(f"saved {save_result(result, args)}")
    if args.plot is not None:
        for path in write_plots(result, args.plot, args.label or result["backend"]):
            print(f"plot {path}")
    return result


def main(argv: list[str] | None = None) -> None:
    run(argv)


if __name__ == "__main__":
    main()
