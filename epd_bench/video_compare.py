"""Video across encoders (`make bench-video`): TTFT of one new 32-frame video, EPD with 2 encoders ÷ 1 encoder.

    python -m epd_bench.video_compare [--rounds 6] [--pinning split|none] [--no-docs]

The comparison of epd_bench/encoder_compare.py on `bench-video` (epd_builders/bench_model.py: a random Qwen2-VL
whose vision tower makes a video's encode most of its TTFT): each request carries a new clip (`epd-bench
--videos-per-request 1 --video-frames 32`, 224x224 at 2 fps), which the proxy cuts into chunks of 16 sampled frames
(--video-chunk-frames); each encoder's frames per second come from its /metrics (decoding, preprocessing and the
vision tower). Results go to runs/bench-video/<time>/; docs/BENCHMARKS.md's `video-bench` section is rewritten.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from epd_bench.encoder_compare import Case
from epd_bench.encoder_compare import main as compare
from epd_bench.loads import Workload
from epd_bench.report import param_counts

FRAMES, FRAME_SIZE, CHUNK_FRAMES = 32, 224, 16
VIDEO = Workload("video32", f"one request at a time, each with a new {FRAMES}-frame {FRAME_SIZE}x{FRAME_SIZE} video "
                 f"({FRAMES // 2} s at 2 fps), 16 words of text, 8 output tokens",
                 ("--images-per-request", "0", "--videos-per-request", "1", "--video-frames", str(FRAMES),
                  "--video-size", str(FRAME_SIZE), "--video-fps", "2", "--max-concurrency", "1",
                  "--random-input-len", "16", "--random-output-len", "8"), 1, 17)


def model_info(model_dir: Path) -> dict[str, Any]:
    """The vision tower's and the LM's sizes from config.json, parameters from the safetensors header (no torch)."""
    config = json.loads((model_dir / "config.json").read_text())
    vision, text = config["vision_config"], config["text_config"]
    params = param_counts(model_dir, lambda k: "vision" if k.startswith("visual.") else "lm")
    return {"family": config.get("model_type"), "vision_depth": vision["depth"], "vision_width": vision["embed_dim"],
            "vision_mlp_ratio": vision.get("mlp_ratio", 4), "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"], "merge_size": vision.get("spatial_merge_size", 2),
            "lm_hidden": text["hidden_size"], "lm_layers": text["num_hidden_layers"],
            "vision_params": params.get("vision", 0), "lm_params": params.get("lm", 0)}


def intro(s: dict[str, Any]) -> str:
    m = s["model_info"]
    side, temporal = FRAME_SIZE // m["patch_size"], FRAMES // m["temporal_patch_size"]
    return (f"Model `{s['model']}` (`epd_builders/bench_model.py`): a random {m['family']} whose vision tower has "
            f"{m['vision_depth']} blocks of width {m['vision_width']} (MLP {m['vision_mlp_ratio']}x), patch "
            f"{m['patch_size']}, {m['temporal_patch_size']} frames per temporal patch: {m['vision_params'] / 1e6:.1f}M "
            f"parameters; its LM has hidden {m['lm_hidden']} and {m['lm_layers']} layers ({m['lm_params'] / 1e6:.1f}M "
            f"with embeddings). {FRAMES} frames are {temporal * side * side // m['merge_size'] ** 2} LM tokens. "
            f"Systems: EPD with 1 and with 2 encoders, one decoder each, pinning `{s['pinning']}` "
            f"(epd_bench/stacks.py), each encoder on one core with one torch thread; the proxy cuts a video into chunks "
            f"of {CHUNK_FRAMES} sampled frames. After one warm-up video each, {s['rounds']} round(s) alternate the "
            "order of the systems; each round sends both the same new clip. The 2-encoder system needs as many free "
            "cores as it has encoders: other work on the machine raises the ratio.")


CASE = Case("video", f"one new {FRAMES}-frame video", "bench-video", VIDEO, FRAMES, "frames",
            ("--video-chunk-frames", str(CHUNK_FRAMES)), f"Video: one {FRAMES}-frame video, EPD with 2 encoders and "
            "with 1", "prefix-bench", model_info, intro)


def main(argv: list[str] | None = None) -> None:
    compare(CASE, argv, __doc__)


if __name__ == "__main__":
    main()
