"""Structured outputs: constrained vs free decoding throughput at 16 concurrent streams, side by side in one run.

    python -m epd_bench.structured [--json] [--streams 16] [--max-tokens 64] [--rounds 3]

Measured through the real decoder `Engine` in this process (continuous batching, one batched forward per step,
the guide's mask applied per row inside the step), on the "small" random LLaVA of epd_bench.decoder_worker. Each round
runs `streams` free requests at once, then the same prompts again with a json_schema guide (an array of nested
objects that cannot end within max_tokens, so both rounds decode the same number of tokens); rounds alternate so
drift hits both. Greedy, EOS ignored. Reported: output tokens/s of each (median over rounds) and their ratio
(target >= 0.8).

The small model's vocabulary is tiny (512), and a grammar mask costs more at a real one: so the report also has
the per-token mask cost (fill + apply) at a 32k byte-level BPE (epd_bench.grammar_cost) and the ratio this run
would have with every constrained row paying that cost instead of the small one.
"""
from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from decoder_service.engine.work import Work
from decoder_service.grammar import CompiledGuide, GuideCompiler
from epd_bench.decoder_worker import SMALL, Bench, small_config
from epd_bench.grammar_cost import NESTED_SCHEMA, large_tokenizer, measure
from epd_bench.micro import emit, parser
from epd_builders.tiny import TinySpec, build_tiny
from epd_contracts.sampling import SamplingParams
from epd_models.guide_spec import GuideSpec, canonical

ITEMS_SCHEMA = {"type": "array", "items": NESTED_SCHEMA, "minItems": 1000}  # never complete within max_tokens


async def round_tps(bench: Bench, prompts: list[Any], max_tokens: int, guide: CompiledGuide | None) -> float:
    """Output tokens/s of len(prompts) requests submitted at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(prompt: Any) -> int:
        job = bench.engine.submit(Work(prompt, params, guide))
        while (event := await job.events.get()).type == "delta":
            pass
        assert event.type == "done" and event.usage is not None, event
        return event.usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens / (time.perf_counter() - start)


async def compare(bench: Bench, streams: int, max_tokens: int, rounds: int) -> dict[str, float]:
    lm = bench.lm
    compiler = GuideCompiler(lm.tokenizer, bench.engine.vocab_size, bench.engine.eos_ids)
    guide = compiler.compile(GuideSpec(kind="json_schema", schema=canonical(ITEMS_SCHEMA)))
    prompts = [bench.prompt(10 + (i * 7) % 40, seed=i) for i in range(streams)]
    await round_tps(bench, prompts[:4], 8, guide)  # warm-up, both paths
    await round_tps(bench, prompts[:4], 8, None)
    free, constrained = [], []
    for _ in range(rounds):
        free.append(await round_tps(bench, prompts, max_tokens, None))
        constrained.append(await round_tps(bench, prompts, max_tokens, guide))
    f, c = statistics.median(free), statistics.median(constrained)
    return {"free_tokens_per_s": round(f, 1), "constrained_tokens_per_s": round(c, 1), "ratio": round(c / f, 3)}


def at_large_vocab(result: dict[str, float], streams: int, small_vocab_mask_us: float, large_vocab: int,
                   repeats: int) -> dict[str, float]:
    """The mask cost at a real vocabulary, and this run's ratio had each constrained token paid it."""
    large = measure("llguidance", large_tokenizer(large_vocab), "json_schema", repeats)["mask_us"]
    step_s = streams / result["constrained_tokens_per_s"]  # one token per stream per step
    step_large_s = step_s + streams * (large - small_vocab_mask_us) * 1e-6
    return {"vocab": large_vocab, "mask_us_per_token": round(large, 1),
            "ratio_estimate": round(streams / step_large_s / result["free_tokens_per_s"], 3)}


def run(spec: TinySpec, streams: int, max_tokens: int, rounds: int, large_vocab: int, repeats: int = 5,
        max_prefill_tokens: int = 2048) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(build_tiny(spec, Path(tmp) / "model"), small_config(max_prefill_tokens))
        try:
            result: dict[str, Any] = asyncio.run(compare(bench, streams, max_tokens, rounds))
        finally:
            bench.close()
        small = measure("llguidance", bench.lm.tokenizer, "json_schema", repeats)["mask_us"]
    report = {"level": "decoder Engine (continuous batching, mask per row in the batched step)",
              "streams": streams, "max_tokens": max_tokens, "rounds": rounds, "grammar": "llguidance",
              **result, "target_ratio_min": 0.8, "mask_us_per_token": round(small, 1)}
    if large_vocab:
        report["at_large_vocab"] = at_large_vocab(result, streams, small, large_vocab, repeats)
    return report


def main(argv: list[str] | None = None) -> None:
    p = parser("structured", __doc__, "print one JSON object")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--large-vocab", type=int, default=32768, help="0: skip the large-vocabulary estimate")
    args = p.parse_args(argv)
    emit(run(SMALL, args.streams, args.max_tokens, args.rounds, args.large_vocab), args.json,
         lambda report: "\n".join(f"{k}: {v}" for k, v in report.items()), indent=2)


if __name__ == "__main__":
    main()
