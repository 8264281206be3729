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
from epd_launcher.group import Secrets, Worker, WorkerGroup
from epd_launcher.placement import Placement, placements, worker_counts


def spawn_workers(group: WorkerGroup, args: argparse.Namespace, keys: Secrets,
                  model_dir: str | Path) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(encoder URLs, decoder URLs, prefill worker URLs) of the workers spawned on `model_dir` (preflight resolved
    --model), once all are healthy."""
    _, workers = start_workers(group, args, keys, model_dir)
    enc, dec, pre = (tuple(w.url for w in workers[role]) for role in ("encoder", "decoder", "prefill"))
    return enc, dec, pre


def start_workers(group: WorkerGroup, args: argparse.Namespace, keys: Secrets,
                  model_dir: str | Path) -> tuple[Spawner, dict[str, list[Worker]]]:
    """Spawn the start's workers, wait until all are healthy; the spawner (for --autoscale) and the workers by role."""
    spawner = Spawner(group, args, keys, model_dir)
    workers = {role: [spawner.spawn(role, i) for i in range(n)]
               for role, n in zip(("encoder", "decoder", "prefill"), worker_counts(args), strict=True)}
    group.wait_healthy(args.startup_timeout)
    return spawner, workers


class Spawner:
    """How the launcher starts one worker of a role: at start (spawn_workers) and later (--autoscale)."""

    def __init__(self, group: WorkerGroup, args: argparse.Namespace, keys: Secrets, model_dir: str | Path):
        self.group, self.args, self.keys, self.model = group, args, keys, str(model_dir)
        self.counts = worker_counts(args)  # (encoders, decoders, prefill workers) at start
        self.threads = max(1, (os.cpu_count() or 1) // max(1, sum(self.counts)))
        self.common = ["--log-level", args.log_level, *_http_flags(args), *_given(args, WORKER_FLAGS),
                       *tracing_flags(TraceSettings(otlp_traces_endpoint=args.otlp_traces_endpoint,
                                                    otlp_traces_sample_ratio=args.otlp_traces_sample_ratio))]
        # the GPUs of each worker (epd_launcher/placement.py): --device, and with --tensor-parallel-size > 1 the
        # decoders' and prefill workers' own CUDA_VISIBLE_DEVICES; preflight refused a set the GPUs cannot hold
        self.places = placements(args)

    def spawn(self, role: str, i: int) -> Worker:
        """Worker `i` of `role` ("encoder", "decoder" or "prefill"). One past those spawned at start (--autoscale)
        gets the placement of the one at i modulo their number, and a fresh port."""
        args, wh = self.args, self.args.worker_host
        first = {"encoder": 0, "decoder": self.counts[0], "prefill": self.counts[0] + self.counts[1]}[role]
        count = self.counts[("encoder", "decoder", "prefill").index(role)]
        index = first + (i % count if count else 0)
        place = self.places[index] if index < len(self.places) else Placement((), {})
        port = _port(args, first + i) if i < count else 0
        if role == "encoder":
            return self.group.spawn("encoder", self.model, wh, self.threads,
                                    ["--ec-bind", f"tcp://{wh}:0", *self.common, *_video_flags(args),
                                     *_given(args, ENCODER_FLAGS), *_encoder_lora_flags(args), *_disk_dir(args, i),
                                     *place.flags], {**self.keys.env("encoder"), **place.env}, port)
        # an aggregated decoder samples and encodes each video itself: it gets the proxy's limits as an encoder does
        aggregated = ["--aggregated", *_video_flags(args)] if args.aggregated else []
        if role == "prefill":
            roles = ["--role", "prefill", "--kv-bind", f"tcp://{wh}:0"]
        else:
            roles = ["--role", "decode"] if self.counts[2] else []  # E -> P -> D: the decoders continue hand-offs
        return self.group.spawn("decoder", self.model, wh, self.threads,
                                [*self.common, *aggregated, *_engine_flags(args), *roles, *place.flags],
                                {**self.keys.env("decoder"), **place.env}, port)


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

