"""Audio across encoders (`make bench-audio`): TTFT of one new 2-minute clip, EPD with 2 encoders ÷ 1 encoder.

    python -m epd_bench.audio_compare [--rounds 6] [--pinning split|none] [--no-docs]

The comparison of epd_bench/encoder_compare.py on `bench-audio` (epd_builders/bench_model.py: a random
Qwen2.5-Omni thinker whose audio tower makes a clip's encode most of its TTFT). The tower encodes 2 s windows
independently, so the proxy cuts a clip into chunks of whole windows, --audio-chunk-seconds each (30: a 120 s clip
is 4 chunks). Each request carries a new clip (`epd-bench --audios-per-request 1 --audio-seconds 120`, a 16 kHz mono
WAV tone); each encoder's seconds of audio per second come from its /metrics. Results go to
runs/bench-audio/<time>/; docs/BENCHMARKS.md's `audio-bench` section is rewritten.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from epd_bench.encoder_compare import Case
from epd_bench.encoder_compare import main as compare
from epd_bench.loads import Workload
from epd_bench.report import param_counts

AUDIO_SECONDS, CHUNK_SECONDS = 120, 30  # the launcher's default --audio-chunk-seconds, written out for the docs
AUDIO = Workload("audio120", f"one request at a time, each with a new {AUDIO_SECONDS} s clip (16 kHz mono WAV, "
                 "an `input_audio` part), 16 words of text, 8 output tokens",
                 ("--images-per-request", "0", "--audios-per-request", "1", "--audio-seconds", str(AUDIO_SECONDS),
                  "--max-concurrency", "1", "--random-input-len", "16", "--random-output-len", "8"), 1, 17)


def _part(key: str) -> str:
    key = key.removeprefix("model.")
    return "audio" if key.startswith("audio_tower.") else "vision" if key.startswith("visual.") else "lm"


def model_info(model_dir: Path) -> dict[str, Any]:
    """The audio tower's and the LM's sizes from config.json, parameters from the safetensors header (no torch)."""
    config = json.loads((model_dir / "config.json").read_text())
    audio, text = config["audio_config"], config["text_config"]
    params = param_counts(model_dir, _part)
    return {"family": config.get("model_type"), "audio_layers": audio["encoder_layers"],
            "audio_width": audio["d_model"], "audio_ffn": audio["encoder_ffn_dim"],
            "audio_heads": audio["encoder_attention_heads"], "window_frames": 2 * audio["n_window"],
            "lm_hidden": text["hidden_size"], "lm_layers": text["num_hidden_layers"],
            "audio_params": params.get("audio", 0), "lm_params": params.get("lm", 0)}


def intro(s: dict[str, Any]) -> str:
    m = s["model_info"]
    window_s = m["window_frames"] / 100  # mel frames at 100 per second
    return (f"Model `{s['model']}` (`epd_builders/bench_model.py`): a random {m['family']} whose audio tower has "
            f"{m['audio_layers']} layers of width {m['audio_width']} ({m['audio_heads']} heads, MLP {m['audio_ffn']}): "
            f"{m['audio_params'] / 1e6:.1f}M parameters, attending within windows of {m['window_frames']} mel frames "
            f"({window_s:g} s), each encoded on its own; its LM has hidden {m['lm_hidden']} and {m['lm_layers']} "
            f"layers ({m['lm_params'] / 1e6:.1f}M with embeddings). A {AUDIO_SECONDS} s clip is "
            f"{AUDIO_SECONDS / window_s:g} windows, {AUDIO_SECONDS * 25} LM tokens. Systems: EPD with 1 and with 2 "
            f"encoders, one decoder each, pinning `{s['pinning']}` (epd_bench/stacks.py), each encoder on one core "
            f"with one torch thread; the proxy cuts a clip into chunks of {CHUNK_SECONDS} s of whole windows "
            f"(`--audio-chunk-seconds`; {-(-AUDIO_SECONDS // CHUNK_SECONDS)} chunks). After one warm-up clip each, "
            f"{s['rounds']} round(s) alternate the order of the systems; each round sends both the same new clip. The "
            "2-encoder system needs as many free cores as it has encoders: other work on the machine raises the ratio.")


CASE = Case("audio", f"one new {AUDIO_SECONDS} s clip", "bench-audio", AUDIO, AUDIO_SECONDS, "audio seconds",
            ("--audio-chunk-seconds", str(CHUNK_SECONDS)), f"Audio: one {AUDIO_SECONDS} s clip, EPD with 2 encoders "
            "and with 1", "video-bench", model_info, intro)


def main(argv: list[str] | None = None) -> None:
    compare(CASE, argv, __doc__)


if __name__ == "__main__":
    main()
