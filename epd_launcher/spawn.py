"""Launcher mode's workers: resolve the model, spawn the encoders and decoders, wait until each is healthy."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from epd_common.tracing import TraceSettings, tracing_flags
from epd_launcher.flags import (
    DECODER_FLAGS,
    DECODER_SWITCHES,
    EC_DISK_DIR,
    ENCODER_FLAGS,
    LORA_MODULES,
    WORKER_FLAGS,
    _dest,
)
from epd_launcher.group import Secrets, WorkerGroup
from epd_launcher.placement import placements, worker_counts


def spawn_workers(group: WorkerGroup, args: argparse.Namespace, keys: Secrets,
                  model_dir: str | Path) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(encoder URLs, decoder URLs, prefill worker URLs) of the workers spawned on `model_dir` (preflight resolved
    --model), once all are healthy."""
    model = str(model_dir)
    num_encoders, _, num_prefills = worker_counts(args)
    threads = max(1, (os.cpu_count() or 1) // max(1, num_encoders + args.num_decoders + num_prefills))
    wh = args.worker_host
    common = ["--log-level", args.log_level, *_http_flags(args), *_given(args, WORKER_FLAGS),
              *tracing_flags(TraceSettings(otlp_traces_endpoint=args.otlp_traces_endpoint,
                                           otlp_traces_sample_ratio=args.otlp_traces_sample_ratio))]
    # the GPUs of each worker (epd_launcher/placement.py): --device, and with --tensor-parallel-size > 1 the
    # decoders' and prefill workers' own CUDA_VISIBLE_DEVICES; preflight refused a set the GPUs cannot hold
    places = placements(args)
    enc = [group.spawn("encoder", model, wh, threads,
                       ["--ec-bind", f"tcp://{wh}:0", *common, *_video_flags(args), *_given(args, ENCODER_FLAGS),
                        *_encoder_lora_flags(args), *_disk_dir(args, i), *places[i].flags], {**keys.env("encoder"), **places[i].env}, _port(args, i))
           for i in range(num_encoders)]
    # an aggregated decoder samples and encodes each video itself: it gets the proxy's limits as an encoder does
    aggregated = ["--aggregated", *_video_flags(args)] if args.aggregated else []
    dec_flags = [*common, *aggregated, *_engine_flags(args)]
    roles = ["--role", "decode"] if num_prefills else []  # E -> P -> D: the decoders continue hand-offs
    dec = [group.spawn("decoder", model, wh, threads, [*dec_flags, *roles, *places[num_encoders + i].flags],
                       {**keys.env("decoder"), **places[num_encoders + i].env}, _port(args, num_encoders + i))
           for i in range(args.num_decoders)]
    first = num_encoders + args.num_decoders
    pre = [group.spawn("decoder", model, wh, threads, [*dec_flags, "--role", "prefill", "--kv-bind", f"tcp://{wh}:0",
                                                       *places[first + i].flags],
                       {**keys.env("decoder"), **places[first + i].env}, _port(args, first + i))
           for i in range(num_prefills)]
    group.wait_healthy(args.startup_timeout)
    return tuple(w.url for w in enc), tuple(w.url for w in dec), tuple(w.url for w in pre)


# the proxy's HTTP flags (epd_common.cli.add_http_flags) every spawned worker takes as they are; not --max-body-bytes:
# a worker's body (an encoder's base64 images, a decoder's whole conversation) is sized by the worker's role
_SHARED_HTTP = ("--body-read-timeout", "--header-timeout", "--timeout-keep-alive", "--max-header-bytes", "--backlog",
                "--send-timeout", "--shutdown-timeout")


def _http_flags(args: argparse.Namespace) -> list[str]:
    """The proxy's HTTP limits for a worker. --limit-concurrency times --proxy-workers: every proxy process may
    hold up to its own limit of calls to one worker (0 stays no limit)."""
    shared = [a for flag in _SHARED_HTTP for a in (flag, str(getattr(args, _dest(flag))))]
    return [*shared, "--limit-concurrency", str(args.limit_concurrency * args.proxy_workers)]


def _port(args: argparse.Namespace, index: int) -> int:
    """Worker `index`'s HTTP port (encoders, then decoders, then prefill workers): --worker-base-port + index, the
    same at every launcher start (an operator's scrape targets); 0: a fresh one."""
    return args.worker_base_port + index if args.worker_base_port else 0


def _video_flags(args: argparse.Namespace) -> list[str]:
    """The proxy's video (and audio) limits for the encoders, which probe each video (clip) again: one the proxy
    takes is not refused there."""
    return ["--max-video-duration", str(args.max_video_duration), "--max-video-frames", str(args.max_video_frames),
            "--max-video-frame-pixels", str(args.max_video_frame_pixels),
            "--max-video-decode-frames", str(args.max_video_decode_frames),
            "--max-audio-seconds", str(args.max_audio_seconds)]


def _disk_dir(args: argparse.Namespace, index: int) -> list[str]:
    """Encoder `index`'s own disk-tier folder (the same one at every restart of it), when --ec-disk-dir is given."""
    folder = getattr(args, _dest(EC_DISK_DIR))
    return [] if folder is None else [EC_DISK_DIR, os.path.join(os.path.abspath(folder), f"encoder-{index}")]


def _encoder_lora_flags(args: argparse.Namespace) -> list[str]:
    """The adapters for the encoders too, which apply their vision-tower weights (encoder_service/lora.py)."""
    loras = getattr(args, _dest(LORA_MODULES))
    if not (args.enable_lora and loras):
        return []
    rank = getattr(args, "max_lora_rank", None)
    return ["--enable-lora", LORA_MODULES, *loras, *(["--max-lora-rank", str(rank)] if rank is not None else [])]


def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The decoder engine flags given on the command line, for every decoder; those not given keep its defaults."""
    switches = [flag for flag, _ in DECODER_SWITCHES if getattr(args, _dest(flag))]
    loras = getattr(args, _dest(LORA_MODULES))
    return [*_given(args, DECODER_FLAGS), *switches, *([LORA_MODULES, *loras] if loras else [])]


def _given(args: argparse.Namespace, specs: tuple[tuple[str, Any, str], ...]) -> list[str]:
    """`flag value` for each of these flags given on the command line (those not given keep the worker's default)."""
    given = [(spec[0], getattr(args, _dest(spec[0]))) for spec in specs]
    return [a for flag, value in given if value is not None for a in (flag, str(value))]

