"""Decoder engine: output tokens/s by concurrency, and inter-token latency while image prefills arrive.

    python -m epd_bench.decoder [--json] [--max-prefill-tokens N]

Builds a "small" random LLaVA (LM hidden 256, 4 layers; CLIP 224/14, 256 image tokens per image) in a
temp dir and drives the real `Engine` in this process (no HTTP, no encoders: image features come from
the vision half directly).
- Throughput: rounds of C requests submitted at once (at least 16 requests per C; text prompts of
  10-50 words, 64 new tokens each, greedy, EOS ignored); output tokens / wall time, C = 1, 4, 16, 64.
- ITL: 8 text streams of 96 tokens alone, then the same with 8 four-image prompts (about 1050 prompt
  tokens each) submitted after the streams' 16th token; p50/p99 of the gaps between consecutive
  tokens of the 8 streams from then until every image prompt has its first token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from connector.tensors.consumer import ECConsumer
from decoder_service.config import DecoderConfig
from decoder_service.engine.llm_engine import Engine
from decoder_service.engine.sequence import Job
from decoder_service.metrics import DecoderMetrics
from decoder_service.prompt import Prompt, build_prompt
from epd_builders.shapes import draw_shape
from epd_builders.tiny import TinySpec, build_tiny
from epd_common.server import freeze_startup_heap
from epd_contracts.sampling import SamplingParams
from epd_models.chat import chat_template, render
from epd_models.halves import LanguageHalf, VisionHalf

SMALL = TinySpec(family="llava", text_hidden=256, text_layers=4, heads=4, kv_heads=2, lm_scale=3.0)
CONCURRENCY = (1, 4, 16, 64)


class Bench:
    def __init__(self, model_dir: Path, max_prefill_tokens: int):
        self.lm, self.vision = LanguageHalf(model_dir), VisionHalf(model_dir)
        self.template = chat_template(self.lm.tokenizer, model_dir)
        cfg = DecoderConfig(max_num_seqs=64, max_prefill_tokens=max_prefill_tokens, max_model_len=2048)
        self.consumer = ECConsumer(cache_bytes=0)
        self.engine = Engine(self.lm, self.consumer, cfg, DecoderMetrics(CollectorRegistry(), self.consumer.stats))

    def prompt(self, num_words: int, num_images: int = 0, seed: int = 0) -> Prompt:
        rng = random.Random(seed)
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
        text = " ".join(rng.choice(["what", "color", "shape", "is", "the", "image"]) for _ in range(num_words))
        ids = render(self.lm.tokenizer, [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                     self.template)
        images = [draw_shape(rng.choice(["red", "blue"]), "circle", rng) for _ in range(num_images)]
        return build_prompt(self.lm, ids, self.vision.encode(images) if images else [])

    async def run(self, prompt: Prompt, max_tokens: int, jobs: list[Job] | None = None) -> int:
        """Submit one request and read its stream; returns its completion tokens."""
        job: Job = self.engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        if jobs is not None:
            jobs.append(job)
        while (event := await job.events.get()).type == "delta":
            pass
        assert event.type == "done" and event.usage is not None, event
        return event.usage.completion_tokens

    async def throughput(self, concurrency: int) -> float:
        """Rounds of `concurrency` requests at once (16 requests at least, so C=1 is not one sample)."""
        rounds = max(1, 16 // concurrency)
        prompts = [self.prompt(10 + (i * 7) % 40, seed=i) for i in range(concurrency * rounds)]
        start, tokens = time.perf_counter(), 0
        for r in range(rounds):
            batch = prompts[r * concurrency : (r + 1) * concurrency]
            tokens += sum(await asyncio.gather(*(self.run(p, 64) for p in batch)))
        return tokens / (time.perf_counter() - start)

    async def itl(self, with_images: bool) -> list[float]:
        """Gaps between consecutive tokens of 8 text streams (while image prompts prefill, if any).

        Token times are taken on the engine thread when each token is chosen, so event-loop delivery
        jitter is not counted.
        """
        images = [self.prompt(10, num_images=4, seed=200 + i) for i in range(8)] if with_images else []
        texts: list[Job] = []
        streams = [asyncio.create_task(self.run(self.prompt(20, seed=100 + i), 96, texts)) for i in range(8)]
        while len(texts) < 8 or min(len(j.token_times) for j in texts) < 16:
            await asyncio.sleep(0.001)
        window_start = time.perf_counter()
        if images:
            await asyncio.gather(*(self.run(p, 1) for p in images))  # one token each: done at its first token
        window_end = time.perf_counter()
        await asyncio.gather(*streams)
        if not images:
            window_end = max(j.token_times[-1] for j in texts)
        return [b - a for j in texts for a, b in zip(j.token_times, j.token_times[1:], strict=False)
                if window_start <= b <= window_end]

    def close(self) -> None:
        self.engine.close()
        self.consumer.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(bench: Bench) -> dict[str, Any]:
    await bench.throughput(4)  # warm-up
    tps = {c: await bench.throughput(c) for c in CONCURRENCY}
    alone, during = await bench.itl(False), await bench.itl(True)
    ms = {name: {"p50_ms": round(statistics.median(v) * 1e3, 2), "p99_ms": round(percentile(v, 0.99) * 1e3, 2),
                 "gaps": len(v)} for name, v in (("alone", alone), ("during_image_prefill", during))}
    return {
        "output_tokens_per_s": {str(c): round(t, 1) for c, t in tps.items()},
        "speedup_16_vs_1": round(tps[16] / tps[1], 2),
        "speedup_64_vs_1": round(tps[64] / tps[1], 2),
        "itl_text_streams": ms,
        "itl_p99_ratio_during_image_prefill": round(ms["during_image_prefill"]["p99_ms"] / ms["alone"]["p99_ms"], 2),
        "targets": {"speedup_16_vs_1_min": 4, "itl_p99_ratio_during_image_prefill_max": 3},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-prefill-tokens", type=int, default=DecoderConfig().max_prefill_tokens)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(build_tiny(SMALL, Path(tmp) / "small"), args.max_prefill_tokens)
        freeze_startup_heap()  # as the decoder server does after loading
        try:
            result = {"model": "small llava (LM hidden 256, 4 layers)", "max_num_seqs": 64,
                      "max_prefill_tokens": args.max_prefill_tokens, **asyncio.run(measure(bench))}
        finally:
            bench.close()
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
