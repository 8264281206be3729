"""epd-bench: load-test any OpenAI-compatible server with a random multimodal workload.

    epd-bench --base-url http://127.0.0.1:8000 --model bench --num-prompts 50 \\
              --images-per-request 2 --repeat-ratio 0.5 --request-rate 2 --save-result --plot plots/
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
`--goodput` SLOs, and TTFT / TPOT / ITL / end-to-end latency statistics; `--save-result` writes them
with every request's timings as JSON, `--plot DIR` draws them.
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
from epd_bench.conversations import MultiTurnSpec, build_conversations, run_conversations
from epd_bench.dataset import DatasetSpec, SampleRequest, build_dataset, repeat_share
from epd_bench.metrics import (
    LATENCY_METRICS,
    BenchmarkMetrics,
    calculate_metrics,
    format_report,
    parse_goodput,
    tpot,
)
from epd_bench.video_clip import check_clip_size

DATASETS = ("random", "multi-turn", "shared-prefix")


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


async def _served_model(client: httpx.AsyncClient, url: str, api_key: str | None) -> str:
    """The first model the server lists (as vLLM's client does when --model is not given)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = await client.get(f"{url}/v1/models", headers=headers)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


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
        model = args.model
        if model is None and args.backend == "openai-chat":
            model = await _served_model(client, url, args.api_key)

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
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def write_plots(result: dict[str, Any], out_dir: Path, label: str) -> list[Path]:
    from epd_bench.plot import plot_latency_cdfs, plot_ttft_over_time  # NOTE: matplotlib only when asked

    runs = {label: result}
    return [plot_latency_cdfs(runs, out_dir / "latency_cdf.png"), plot_ttft_over_time(runs, out_dir / "ttft_over_time.png")]


def _image_size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    size = (int(w), int(h or w))
    if min(size) < 1:
        raise argparse.ArgumentTypeError(f"image size must be positive: {text!r}")
    return size


def _rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf): {text!r}")
    return rate


def _csv(kind: type) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("epd-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--backend", choices=sorted(BACKENDS), default="openai-chat",
                   help="openai-chat: /v1/chat/completions; epd-decoder: an EPD decoder's own POST /generate")
    t.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is ok)")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=8000)
    t.add_argument("--model", default=None, help="the `model` to send (default: the first of GET /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (env OPENAI_API_KEY)")
    t.add_argument("--request-timeout", type=float, default=600.0, help="seconds to wait for a response or a chunk")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random: independent prompts; multi-turn: conversations resending their history; "
                        "shared-prefix: random, every request with the same system message")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--random-input-len", type=int, default=32,
                   help="words of text per prompt (multi-turn: per question; ~1 token each, ~3.5 for bench models)")
    d.add_argument("--random-output-len", type=int, default=64, help="max_tokens per request")
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)")
    d.add_argument("--images-per-request", type=int, default=None,
                   help="default 1 (multi-turn: in the first turn), shared-prefix 0")
    d.add_argument("--system-prompt-len", type=int, default=None,
                   help="words of the system message every request carries; default 0, shared-prefix 256")
    d.add_argument("--conversations", type=int, default=None,
                   help="multi-turn: conversations (default: --num-prompts / --turns, rounded up)")
    d.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    d.add_argument("--image-size", type=_image_size, default=(224, 224), help="N or WxH pixels")
    d.add_argument("--image-format", choices=["jpeg", "png"], default="jpeg")
    d.add_argument("--videos-per-request", type=int, default=0,
                   help="video clips per request (multi-turn: in the first turn), after the images; each a PyAV-made "
                        "H.264 MP4 sent as a `video_url` data: URL")
    d.add_argument("--video-frames", type=int, default=32,
                   help="frames of each clip; the request asks for all of them (mm_processor_kwargs.num_frames)")
    d.add_argument("--video-size", type=_image_size, default=(224, 224), help="N or WxH pixels per frame (even)")
    d.add_argument("--video-fps", type=float, default=2.0, help="the clips' frame rate (32 frames: 16 s)")
    d.add_argument("--audios-per-request", type=int, default=0,
                   help="audio clips per request (multi-turn: in the first turn), after the videos; each a 16 kHz "
                        "mono WAV tone, distinct per clip, sent as an `input_audio` part (base64)")
    d.add_argument("--audio-seconds", type=float, default=10.0, help="length of each audio clip in seconds")
    d.add_argument("--repeat-ratio", type=float, default=0.0,
                   help="share of images (and videos, audio clips) that repeat one an earlier request sent (0..1)")
    d.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrival times")
    d.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/EPD extension) so every "
                   "answer has --random-output-len tokens")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (Poisson); inf: all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests (multi-turn: conversations) in flight; "
                           "--request-rate sets when conversations start")
    load.add_argument("--num-warmups", type=int, default=0,
                      help="requests (multi-turn: one-turn conversations) sent one by one first, not measured")
    load.add_argument("--disable-tqdm", action="store_true")
    r = p.add_argument_group("results")
    r.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS (a request counts when it meets all given)")
    r.add_argument("--percentile-metrics", type=_csv(str), default=list(LATENCY_METRICS),
                   help="comma-separated subset of ttft,tpot,itl,e2el")
    r.add_argument("--metric-percentiles", type=_csv(float), default=[50.0, 90.0, 99.0], help="e.g. 50,90,99")
    r.add_argument("--save-result", action="store_true", help="write the result JSON")
    r.add_argument("--save-detailed", action="store_true", help="also save every generated text")
    r.add_argument("--result-dir", default=None)
    r.add_argument("--result-filename", default=None)
    r.add_argument("--label", default=None, help="names this run in file names and plots")
    r.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write latency_cdf.png and "
                   "ttft_over_time.png here")
    return p


def _dataset_defaults(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the flags whose default depends on --dataset, and check the dataset's own flags."""
    shared = args.dataset == "shared-prefix"
    if args.images_per_request is None:
        args.images_per_request = 0 if shared else 1
    if args.system_prompt_len is None:
        args.system_prompt_len = 256 if shared else 0
    if shared and args.system_prompt_len < 1:
        p.error("--dataset shared-prefix needs --system-prompt-len >= 1")
    if args.turns < 1:
        p.error("--turns must be >= 1")
    if args.conversations is None:
        args.conversations = -(-args.num_prompts // args.turns)
    for flag in ("num_prompts", "images_per_request", "system_prompt_len", "conversations", "videos_per_request",
                 "audios_per_request"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0")
    if args.videos_per_request:
        _video_flags(p, args)
    if args.audios_per_request:
        if args.backend == "epd-decoder":
            p.error("--audios-per-request needs the openai-chat backend (a decoder takes audio only as the proxy "
                    "plans it)")
        if not args.audio_seconds > 0:
            p.error("--audio-seconds must be > 0")


def _video_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.backend == "epd-decoder":
        p.error("--videos-per-request needs the openai-chat backend (a decoder takes a video only as the proxy "
                "plans it)")
    if args.video_frames < 1 or not args.video_fps > 0:
        p.error("--video-frames must be >= 1 and --video-fps > 0")
    try:
        check_clip_size(*args.video_size)
    except ValueError as exc:
        p.error(f"--video-size: {exc}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.goodput = parse_goodput(args.goodput)
    except ValueError as exc:
        p.error(str(exc))
    if unknown := set(args.percentile_metrics) - set(LATENCY_METRICS):
        p.error(f"--percentile-metrics: unknown {sorted(unknown)}; choose from {','.join(LATENCY_METRICS)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not 0.0 <= args.repeat_ratio <= 1.0:
        p.error("--repeat-ratio must be in [0, 1]")
    _dataset_defaults(p, args)
    args.percentile_metrics = tuple(args.percentile_metrics)
    return args


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse, benchmark, print the report, save and plot as asked; returns the result JSON."""
    args = parse_args(argv)
    result, metrics = asyncio.run(benchmark(args))
    print(format_report(metrics))
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
