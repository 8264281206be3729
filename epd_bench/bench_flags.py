"""epd-bench's command line: its flags, the defaults that depend on --dataset, and their checks (a usage error
exits 2 before any request)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

from epd_bench.backends import BACKENDS
from epd_bench.metrics import LATENCY_METRICS, parse_goodput
from epd_bench.video_clip import check_clip_size

DATASETS = ("random", "multi-turn", "shared-prefix")


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


def build_parser(doc: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("epd-bench", description=doc, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--backend", choices=sorted(BACKENDS), default="openai-chat",
                   help="openai-chat: /v1/chat/completions; epd-decoder: an EPD decoder's own POST /generate")
    t.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is ok)")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=8000)
    t.add_argument("--model", default=None, help="the `model` to send (default: the first of GET /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (env OPENAI_API_KEY)")
    t.add_argument("--request-timeout", type=float, default=600.0, help="seconds to wait for a response or a chunk")
    _add_dataset_flags(p.add_argument_group("dataset"))
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (Poisson); inf: all at once")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests (multi-turn: conversations) in flight; "
                           "--request-rate sets when conversations start")
    load.add_argument("--num-warmups", type=int, default=0,
                      help="requests (multi-turn: one-turn conversations) sent one by one first, not measured")
    load.add_argument("--disable-tqdm", action="store_true")
    _add_result_flags(p.add_argument_group("results"))
    return p


def _add_dataset_flags(d: argparse._ActionsContainer) -> None:
    """What each request carries: its text, images, videos and audio clips, and how often media repeat."""
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


def _add_result_flags(r: argparse._ActionsContainer) -> None:
    """What the run reports and where it saves it."""
    r.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS (a request counts when it meets all given)")
    r.add_argument("--percentile-metrics", type=_csv(str), default=list(LATENCY_METRICS),
                   help="comma-separated subset of ttft,tpot,itl,e2el")
    r.add_argument("--metric-percentiles", type=_csv(float), default=[50.0, 90.0, 99.0], help="e.g. 50,90,99")
    r.add_argument("--save-result", action="store_true", help="write the result JSON")
    r.add_argument("--save-detailed", action="store_true", help="also save every generated text")
    r.add_argument("--result-dir", default=None, help="where --save-result writes (default: runs/epd-bench, "
                   "git-ignored)")
    r.add_argument("--result-filename", default=None)
    r.add_argument("--label", default=None, help="names this run in file names and plots")
    r.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write latency_cdf.png and "
                   "ttft_over_time.png here")


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


def parse_args(argv: list[str] | None = None, doc: str | None = None) -> argparse.Namespace:
    p = build_parser(doc)
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
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: .venv/bin/pip install -e '.[bench]' (or pip install matplotlib)")
    args.percentile_metrics = tuple(args.percentile_metrics)
    return args
