"""The decoder engine measured in this process: tokens/s, inter-token latency, host cost per step, K/V memory.

Run by epd_bench/decoder.py, in its own process or (`--base`) beside an older revision: it imports only what
every revision since the engine's first host-cost benchmark has (the engine module by either of its paths, config fields by getattr), and
loads epd_bench/step_clock.py by its path, so `PYTHONPATH=<old tree> python -c "runpy.run_path(<this file>)"`
measures the old engine with this file's code.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from connector.tensors.consumer import ECConsumer
from decoder_service.config import DecoderConfig
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
HOST_ROWS = (16, 64)


def engine_class() -> Any:
    """The service's engine (the shell over LLMEngine); before the engine became a layer, the engine package's."""
    for module in ("decoder_service.shell", "decoder_service.engine.llm_engine", "decoder_service.engine"):
        try:
            return importlib.import_module(module).Engine
        except (ImportError, AttributeError):  # an older tree lacks it (or finds this tree's, which needs newer names)
            continue
    raise ImportError("no decoder engine class found")


def step_clock_class() -> Any:
    spec = importlib.util.spec_from_file_location("_epd_step_clock", Path(__file__).with_name("step_clock.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.StepClock


def decoder_config(**fields: Any) -> DecoderConfig:
    """Fields this revision's DecoderConfig lacks (an older one) are left out."""
    known = {f.name for f in dataclasses.fields(DecoderConfig)}
    return DecoderConfig(**{k: v for k, v in fields.items() if k in known})


class Bench:
    def __init__(self, model_dir: Path, cfg: DecoderConfig, vision: bool = True):
        self.lm = LanguageHalf(model_dir)
        self.vision = VisionHalf(model_dir) if vision else None
        self.template = chat_template(self.lm.tokenizer, model_dir)
        self.consumer = ECConsumer(cache_bytes=0)
        self.engine = engine_class()(self.lm, self.consumer, cfg, DecoderMetrics(CollectorRegistry(),
                                                                                 self.consumer.stats))
        self.clock = step_clock_class()(self.engine)

    def words(self, num_words: int, num_images: int = 0, seed: int = 0) -> list[int]:
        rng = random.Random(seed)
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
        text = " ".join(rng.choice(["what", "color", "shape", "is", "the", "image"]) for _ in range(num_words))
        return render(self.lm.tokenizer, [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                      self.template)

    def prompt(self, num_words: int, num_images: int = 0, seed: int = 0) -> Prompt:
        images = []
        if num_images:
            assert self.vision is not None
            rng = random.Random(seed + 1)
            images = self.vision.encode([draw_shape(rng.choice(["red", "blue"]), "circle", rng)
                                         for _ in range(num_images)])
        return build_prompt(self.lm, self.words(num_words, num_images, seed), images)

    async def run(self, prompt: Prompt, max_tokens: int, jobs: list[Any] | None = None) -> int:
        """Submit one request and read its stream; returns its completion tokens."""
        job = self.engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        if jobs is not None:
            jobs.append(job)
        while (event := await job.events.get()).type == "delta":
            pass
        assert event.type == "done" and event.usage is not None, event
        return int(event.usage.completion_tokens)

    async def throughput(self, concurrency: int) -> float:
        """Rounds of `concurrency` requests at once (16 requests at least, so C=1 is not one sample)."""
        rounds = max(1, 16 // concurrency)
        prompts = [self.prompt(10 + (i * 7) % 40, seed=i) for i in range(concurrency * rounds)]
        start, tokens = time.perf_counter(), 0
        for r in range(rounds):
            batch = prompts[r * concurrency : (r + 1) * concurrency]
            tokens += sum(await asyncio.gather(*(self.run(p, 64) for p in batch)))
        return tokens / (time.perf_counter() - start)

    async def host_cost(self, rows: int, max_tokens: int = 192) -> dict[str, Any] | None:
        """`rows` requests at once, long enough that most steps decode all of them: the host cost per row of those
        steps, by phase; then again with the per-row hooks, splitting postprocess (epd_bench/step_clock.py)."""
        out = await self._clocked(rows, max_tokens, per_row=False)
        split = await self._clocked(rows, max_tokens, per_row=True)
        if out is not None and split is not None:
            phases = split["phases_us_per_row"]
            out["postprocess_split_us_per_row"] = {"sampling": phases.pop("postprocess"), **phases}
        return out

    async def _clocked(self, rows: int, max_tokens: int, per_row: bool) -> dict[str, Any] | None:
        prompts = [self.prompt(10 + (i * 7) % 40, seed=1000 + i) for i in range(rows)]
        self.clock.steps.clear()
        self.clock.per_row_hooks(per_row)
        self.clock.enabled = True
        try:
            await asyncio.gather(*(self.run(p, max_tokens) for p in prompts))
        finally:
            self.clock.enabled = False
            self.clock.per_row_hooks(False)
        if per_row:
            return self.clock.report(rows, ("postprocess", "accept", "detokenize", "events"))
        return self.clock.report(rows)

    async def itl(self, with_images: bool) -> list[float]:
        """Gaps between consecutive tokens of 8 text streams (while image prompts prefill, if any); token times
        are taken on the engine thread when each token is chosen, so event-loop delivery jitter is not counted."""
        images = [self.prompt(10, num_images=4, seed=200 + i) for i in range(8)] if with_images else []
        texts: list[Any] = []
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


async def speed(bench: Bench, concurrency: tuple[int, ...]) -> dict[str, Any]:
    """Output tokens/s by concurrency, then the host cost of decode steps at 16 and 64 rows."""
    await bench.throughput(4)  # warm-up
    tps = {c: await bench.throughput(c) for c in concurrency}
    host = {str(n): await bench.host_cost(n) for n in HOST_ROWS}
    return {"output_tokens_per_s": {str(c): round(t, 1) for c, t in tps.items()}, "step_host_us_per_row": host}


async def latency(bench: Bench) -> dict[str, Any]:
    alone, during = await bench.itl(False), await bench.itl(True)
    ms = {name: {"p50_ms": round(statistics.median(v) * 1e3, 2), "p99_ms": round(percentile(v, 0.99) * 1e3, 2),
                 "gaps": len(v)} for name, v in (("alone", alone), ("during_image_prefill", during))}
    return {"itl_text_streams": ms, "itl_p99_ratio_during_image_prefill":
            round(ms["during_image_prefill"]["p99_ms"] / ms["alone"]["p99_ms"], 2)}


def small_config(max_prefill_tokens: int) -> DecoderConfig:
    return decoder_config(max_num_seqs=64, max_prefill_tokens=max_prefill_tokens, max_model_len=2048)


def run_small(parts: list[str], max_prefill_tokens: int) -> dict[str, Any]:
    """The speed parts on the small LLaVA (LM hidden 256, 4 layers), built in a temp dir."""
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(build_tiny(SMALL, Path(tmp) / "small"), small_config(max_prefill_tokens))
        freeze_startup_heap()  # as the decoder server does after loading
        try:
            out: dict[str, Any] = {}
            if "speed" in parts:
                out.update(asyncio.run(speed(bench, CONCURRENCY if "latency" in parts else (16, 64))))
            if "latency" in parts:
                out.update(asyncio.run(latency(bench)))
            return out
        finally:
            bench.close()


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--parts", default="speed,latency", help="comma-separated: speed, latency, memory")
    p.add_argument("--max-prefill-tokens", type=int, default=DecoderConfig().max_prefill_tokens)
    args = p.parse_args()
    parts = args.parts.split(",")
    out: dict[str, Any] = run_small(parts, args.max_prefill_tokens) if {"speed", "latency"} & set(parts) else {}
    if "memory" in parts:
        from epd_bench.decoder_memory import run_memory  # this tree only: the base has no K/V budget
        out["memory"] = run_memory()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
