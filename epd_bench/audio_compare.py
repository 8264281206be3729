"""Audio across encoders (issue 35's bench row): TTFT of one new 2-minute clip, EPD with 2 encoders ÷ 1 encoder.

    python -m epd_bench.audio_compare [--rounds 6] [--pinning split|none] [--no-docs]

Systems (epd_bench/stacks.py): EPD with 1 encoder and EPD with 2 encoders, one decoder each, on `bench-audio`
(epd_builders/bench_model.py: a random Qwen2.5-Omni thinker whose audio tower makes a clip's encode most of its
TTFT). Qwen2.5-Omni's tower encodes 2 s windows independently, so the proxy cuts a clip into chunks of whole windows,
--audio-chunk-seconds each (30: a 120 s clip is 4 chunks), which the scheduler spreads over the encoders. Pinning
as in epd_bench/video_compare.py: under "split" each encoder has one core of its own where the machine has them (on
2 cores the second encoder shares the decoder's, which waits for the clip meanwhile) and runs one torch thread.
Both systems are started together and answer one warm-up clip each, then the rounds alternate their order: round r
sends each system one request carrying a new clip (`epd-bench --audios-per-request 1 --audio-seconds 120`, a 16 kHz
mono WAV tone, seed + 100 r), the same clip to both; a new clip every round, so nothing is cached and every TTFT
includes encoding the whole clip.

Seconds of audio encoded per second per encoder come from each encoder's /metrics around every measured request
(video_compare's counters): the clip's seconds times the encoder's share of the chunks encoded for that request
(the chunks are whole windows of equal length) over the time it worked on them (decoding the WAV, the mel features,
the audio tower): its `epd_encoder_run_seconds` where it reports them, else worked out from its calls' wall times.
Results go to runs/bench-audio/<time>/; the target is printed and the `audio-bench` section of docs/BENCHMARKS.md
is rewritten.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

from epd_bench import audio_report
from epd_bench.compare import (
    RunStart,
    Workload,
    finish,
    start_measure_stop,
    systems_summary,
)
from epd_bench.stacks import Running, SystemSpec, epd
from epd_bench.video_compare import encoder_compare_args, measure_rounds

AUDIO_SECONDS = 120
CHUNK_SECONDS = 30  # the launcher's default --audio-chunk-seconds, written out so the docs show it
SYSTEMS = {"epd-1enc": 1, "epd-2enc": 2}
DECODER_FLAGS = ("--max-num-seqs", "4")  # one request at a time: a few KV slots keep the decoder small
PROXY_FLAGS = ("--audio-chunk-seconds", str(CHUNK_SECONDS))
AUDIO = Workload("audio120", f"one request at a time, each with a new {AUDIO_SECONDS} s clip (16 kHz mono WAV, "
                 "an `input_audio` part), 16 words of text, 8 output tokens",
                 ("--images-per-request", "0", "--audios-per-request", "1", "--audio-seconds", str(AUDIO_SECONDS),
                  "--max-concurrency", "1", "--random-input-len", "16", "--random-output-len", "8"), 1, 17)
BUILD_PRESET = "bench-audio"  # epd_builders/bench_model.py's preset, built once and cached (epd_models/resolve.py)


def build_systems(model_dir: Path, cores: int, pin: bool) -> list[SystemSpec]:
    return [epd(model_dir, n, cores, pin, decoder_flags=DECODER_FLAGS, name=name, proxy_flags=PROXY_FLAGS)
            for name, n in SYSTEMS.items()]


def audio_work(work: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """encoder_work's per-encoder figures with its "frames" (the clip's share the encoder encoded) named for what
    they are here: seconds of audio."""
    return {name: {"audio_s": w["frames"], "seconds": w["seconds"]} for name, w in work.items()}


def audio_per_second(work: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """Per encoder: seconds of audio encoded per second it worked (None when it did no work)."""
    return {name: w["audio_s"] / w["seconds"] if w["seconds"] > 0 else None for name, w in work.items()}


def measure(up: list[Running], args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """A warm-up clip per system, then the rounds (alternating order); TTFTs pooled, encoder work summed."""
    measured = measure_rounds(up, args.rounds, run_dir, AUDIO, AUDIO_SECONDS, "audio")
    work = {name: audio_work(w) for name, w in measured["encoder_work"].items()}
    return {**measured, "encoder_work": work, "audio_per_s": {name: audio_per_second(w) for name, w in work.items()}}


def model_info(model_dir: Path) -> dict[str, Any]:
    """The audio tower's and the LM's sizes from config.json, parameters from the safetensors header (no torch)."""
    config = json.loads((model_dir / "config.json").read_text())
    audio, text = config["audio_config"], config["text_config"]
    with (model_dir / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))

    def part(key: str) -> str:
        key = key.removeprefix("model.")
        return "audio" if key.startswith("audio_tower.") else "vision" if key.startswith("visual.") else "lm"

    params = {"audio": 0, "vision": 0, "lm": 0}
    for k, v in header.items():
        if k != "__metadata__":
            params[part(k)] += math.prod(v["shape"])
    return {"family": config.get("model_type"), "audio_layers": audio["encoder_layers"],
            "audio_width": audio["d_model"], "audio_ffn": audio["encoder_ffn_dim"],
            "audio_heads": audio["encoder_attention_heads"], "window_frames": 2 * audio["n_window"],
            "lm_hidden": text["hidden_size"], "lm_layers": text["num_hidden_layers"],
            "audio_params": params["audio"], "lm_params": params["lm"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started, run_dir, _, model_dir, pin = run = RunStart.of(args)
    specs = build_systems(model_dir, len(os.sched_getaffinity(0)), pin)
    measured, skipped = start_measure_stop(specs, run_dir, started, lambda up: measure(up, args, run_dir))
    summary = {**run.summary_head(args.model, model_info(model_dir)),
               "rounds": args.rounds, "audio_seconds": AUDIO_SECONDS, "chunk_seconds": CHUNK_SECONDS,
               "skipped": skipped, "systems": systems_summary(specs, skipped),
               "workload": {"name": AUDIO.name, "title": AUDIO.title},
               **measured, "wall_s": round(time.monotonic() - started, 1)}
    finish(summary, run_dir, audio_report.targets(summary), audio_report.targets_text(summary),
           None if args.no_docs else lambda: audio_report.write_docs(summary, args.docs),
           f"{args.docs} (audio-bench section)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return encoder_compare_args(argv, "python -m epd_bench.audio_compare", __doc__, BUILD_PRESET,
                                "a model that takes audio and encodes windows apart", "bench-audio")


if __name__ == "__main__":
    main()
