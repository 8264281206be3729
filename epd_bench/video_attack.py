"""One hostile video request against everyone else (a long, near-still 720p clip): a victim's image TTFT while it runs, base ÷ now.

    python -m epd_bench.video_attack --base <rev> [--rounds 2] [--seconds 40] [--json]

Two EPD stacks of `bench-video` (epd_bench/stacks.py `epd`: 1 encoder, 1 decoder with --max-model-len 2048, the
proxy with --video-chunk-frames 4), one running `--base` (exported with `git archive`, epd_bench/revisions.py), one
this working tree, started at once and attacked in turn. The attack clip is built here with PyAV as a hostile client would:
H.264 1280x720 at 60 fps, near-still (one small square moves), a keyframe every 250 frames; each round remuxes it
with another container title, so its bytes (and its hash) are new and nothing is cached. Per round and stack:

- `idle`: the victim alone: a streamed request with a new image, seconds to its first content token;
- `refused`: the clip at the model's default sampling (2 fps: 80 frames, 20 chunks), whose tokens pass the
  context: the victim is sent 1 s after the attack, and the attack's status and the frames its encoder encoded
  are recorded (before: every chunk is decoded and encoded, then the decoder says context_length_exceeded);
- `fits`: the same clip with mm_processor_kwargs.num_frames = 32 (8 chunks), which fits and is served: the
  victim's image queues at the one encoder with the chunks (before: behind all of them, each decoded from frame 0).

Timing claims are these ratios, measured side by side on the same machine; the tests assert only orders and counts.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import av
import httpx
import numpy as np

from epd_bench.encoder_compare import metric_sum
from epd_bench.pipeline import image_url
from epd_bench.revisions import ROOT, export_revision, shipped_path
from epd_bench.stacks import Running, SystemSpec, epd
from epd_models.resolve import resolve_model

GOP, FPS, WIDTH, HEIGHT = 250, 60, 1280, 720
ATTACKS = {"refused": None, "fits": {"num_frames": 32}}  # mm_processor_kwargs of each attack
VICTIM_DELAY_S = 1.0  # the victim follows the attack by this much: the attack's chunks are queued by then


def build_clip(seconds: float) -> bytes:
    """The near-still 720p clip: a grey-green picture with a noisy strip, a red square moving one pixel a frame."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = cast(av.VideoStream, out.add_stream("libx264", rate=FPS))
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.options = {"preset": "ultrafast", "x264-params": f"keyint={GOP}:min-keyint={GOP}:scenecut=0"}
        still = np.full((HEIGHT, WIDTH, 3), 90, np.uint8)
        still[: HEIGHT // 2, :, 1] = 140
        still[:, : WIDTH // 8] = np.random.default_rng(0).integers(0, 255, (HEIGHT, WIDTH // 8, 3), dtype=np.uint8)
        for i in range(int(seconds * FPS)):
            pixels = still.copy()
            pixels[HEIGHT // 2 - 16: HEIGHT // 2 + 16, i % (WIDTH - 32): i % (WIDTH - 32) + 32] = (250, 30, 30)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def retitled(data: bytes, title: str) -> bytes:
    """The same packets in a new MP4 whose title differs: other bytes, the same frames."""
    buf = io.BytesIO()
    with av.open(io.BytesIO(data), "r") as src, av.open(buf, "w", format="mp4") as out:
        out.metadata["title"] = title
        video = src.streams.video[0]
        stream = out.add_stream_from_template(video)
        for packet in src.demux(video):
            if packet.dts is not None:
                packet.stream = stream
                out.mux(packet)
    return buf.getvalue()


def stack(name: str, model_dir: Path, pythonpath: str) -> SystemSpec:
    spec = epd(model_dir, 1, 2, False, decoder_flags=("--max-model-len", "2048", "--max-num-seqs", "4"), name=name,
               proxy_flags=("--video-chunk-frames", "4"))
    return replace(spec, procs=tuple(replace(p, env=(*p.env, ("PYTHONPATH", pythonpath))) for p in spec.procs))


def victim_ttft(client: httpx.Client, spec: SystemSpec, seed: int) -> float:
    content = [{"type": "image_url", "image_url": {"url": image_url(seed)}}, {"type": "text", "text": "Which?"}]
    body = {"model": spec.model, "stream": True, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    start = time.perf_counter()
    with client.stream("POST", f"{spec.url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():  # the first token: content, or the end of a choice whose tokens are no text
            choice = json.loads(line[6:])["choices"][0] if line.startswith("data: {") else {}
            if choice.get("delta", {}).get("content") or choice.get("finish_reason"):
                return time.perf_counter() - start
    raise RuntimeError(f"{spec.name}: the victim got no token")


def attack(client: httpx.Client, spec: SystemSpec, clip: bytes, kwargs: dict[str, Any] | None,
           out: dict[str, Any]) -> None:
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What?"}]
    body = {"model": spec.model, "max_tokens": 2, "messages": [{"role": "user", "content": content}],
            **({"mm_processor_kwargs": kwargs} if kwargs else {})}
    start = time.perf_counter()
    resp = client.post(f"{spec.url}/v1/chat/completions", json=body)
    out.update(status=resp.status_code, seconds=round(time.perf_counter() - start, 2),
               code=resp.json().get("error", {}).get("code") if resp.status_code != 200 else None)


def encoded_items(spec: SystemSpec) -> float:
    return metric_sum(httpx.get(f"{spec.procs[0].url}/metrics", timeout=30).text,
                      "epd_encoder_items_encoded_total") or 0.0


def one_round(client: httpx.Client, spec: SystemSpec, clip: bytes, seed: int) -> dict[str, Any]:
    row: dict[str, Any] = {"idle": round(victim_ttft(client, spec, seed), 3)}
    for i, (name, kwargs) in enumerate(ATTACKS.items()):
        outcome: dict[str, Any] = {}
        before = encoded_items(spec)
        thread = threading.Thread(target=attack, args=(client, spec, clip, kwargs, outcome))
        thread.start()
        time.sleep(VICTIM_DELAY_S)
        outcome["victim_ttft"] = round(victim_ttft(client, spec, seed + 1 + i), 3)
        thread.join()
        outcome["chunks_encoded"] = encoded_items(spec) - before
        row[name] = outcome
    return row


def measure(specs: list[SystemSpec], clip: bytes, rounds: int) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in specs}
    with httpx.Client(timeout=600) as client:
        for s in specs:
            victim_ttft(client, s, 10_000)  # warm-up: imports, connections, the first encode
        for r in range(rounds):
            for s in specs if r % 2 else specs[::-1]:
                results[s.name].append(one_round(client, s, retitled(clip, f"{s.name} round {r}"), 100 * r))
    return results


def summary(results: dict[str, list[dict[str, Any]]], before: str, after: str) -> dict[str, Any]:
    """Median victim TTFT per case and stack, and after ÷ before."""
    def median(name: str, case: str) -> float:
        return statistics.median(r[case] if case == "idle" else r[case]["victim_ttft"] for r in results[name])
    cases = ["idle", *ATTACKS]
    out: dict[str, Any] = {f"{case}_victim_ttft_s": {n: round(median(n, case), 3) for n in (before, after)}
                           for case in cases}
    for case in cases:
        out[f"{case}_after_vs_before"] = round(median(after, case) / median(before, case), 3)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the revision to compare this working tree with (a git rev)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=40.0, help="length of the attack clip")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args(argv)
    sha, tree = export_revision(args.base)
    model_dir = resolve_model("bench-video")
    clip = build_clip(args.seconds)
    specs = [stack("before", model_dir, shipped_path(tree)), stack("after", model_dir, str(ROOT))]
    logs = ROOT / "runs" / "video-attack" / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True)
    os.chdir(logs)  # NOTE: `python -m` puts the working directory first on sys.path: in ROOT, "before" would run ROOT
    running = [Running(s, logs) for s in specs]
    try:
        for r in running:
            r.wait_healthy(300)
        results = measure(specs, clip, args.rounds)
    finally:
        for r in running:
            r.stop()
    report = {"base": sha[:12], "clip_bytes": len(clip), "clip": f"{args.seconds:g} s, {WIDTH}x{HEIGHT}, {FPS} fps, "
              f"keyframe every {GOP}", "rounds": results, "summary": summary(results, "before", "after")}
    (logs / "result.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report if args.json else report["summary"], indent=2))


if __name__ == "__main__":
    main()
