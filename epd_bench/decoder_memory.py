"""How many sequences a 1 GiB K/V budget runs at once: the paged engine against today's preallocated slots.

On `bench-lm` (epd_builders/bench_model.py: 8-layer Llama, hidden 512, 2 K/V heads of 64, float32: 8 KiB of K/V
per token) with `kv_cache_memory=1 GiB`, `max_model_len=8192`, `max_num_seqs=256`: `REQUESTS` text prompts of 200
to 1,500 tokens (uniform, seeded) are submitted at once, `MAX_TOKENS` greedy new tokens each (EOS ignored), far
more than the pool holds; the engine's `scheduler.peak_running` is the most sequences it ran at once. Today's
engine gave each of `max_num_seqs` slots `max_model_len` positions up front, so the same bytes held
floor(1 GiB / (8192 x bytes per token)) sequences (`decoder_service/engine/kv_shape.py` `KVShape`).
"""
from __future__ import annotations

import asyncio
import importlib.util
import random
import time
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from connector.tensors.consumer import ECConsumer
from decoder_service.config import DecoderConfig
from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.llm_engine import Engine
from decoder_service.metrics import DecoderMetrics
from decoder_service.prompt import Prompt
from epd_builders.bench_model import BENCH_LM_SPEC, ensure_bench_model
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf

KV_BUDGET = 1 << 30
MAX_MODEL_LEN, MAX_NUM_SEQS = 8192, 256
REQUESTS, MAX_TOKENS, PROMPT_TOKENS = 192, 96, (200, 1500)


def prompts(lm: LanguageHalf, n: int, seed: int = 0) -> list[Prompt]:
    """n prompts of ordinary (non-special) token ids, each of a length drawn from PROMPT_TOKENS."""
    rng = random.Random(seed)
    special = set(lm.tokenizer.all_special_ids)
    ordinary = [i for i in range(len(lm.tokenizer)) if i not in special and i != lm.image_token_id]
    return [Prompt(input_ids=torch.tensor([[rng.choice(ordinary) for _ in range(rng.randint(*PROMPT_TOKENS))]]),
                   images=[]) for _ in range(n)]


async def drive(engine: Engine, batch: list[Prompt]) -> int:
    async def one(prompt: Prompt) -> int:
        job = engine.submit(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        while (event := await job.events.get()).type == "delta":
            pass
        assert event.type == "done" and event.usage is not None, event
        return int(event.usage.completion_tokens)
    return sum(await asyncio.gather(*(one(p) for p in batch)))


def run_memory() -> dict[str, Any]:
    if importlib.util.find_spec("decoder_service.engine.block_manager") is None:
        return {"skipped": "this tree's engine has no K/V block pool"}  # it would preallocate 256 x 8192 positions
    lm = LanguageHalf(ensure_bench_model(BENCH_LM_SPEC, "bench-lm"))
    shape = KVShape.of(lm.config.get_text_config(), next(lm.module.parameters()).dtype)
    cfg = DecoderConfig(kv_cache_memory=KV_BUDGET, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)
    consumer = ECConsumer(cache_bytes=0)
    engine = Engine(lm, consumer, cfg, DecoderMetrics(CollectorRegistry(), consumer.stats))
    batch = prompts(lm, REQUESTS)
    start = time.perf_counter()
    try:
        tokens = asyncio.run(drive(engine, batch))
    finally:
        engine.close()
        consumer.close()
    slots = KV_BUDGET // (MAX_MODEL_LEN * shape.bytes_per_token)
    peak = engine.scheduler.peak_running
    return {"model": "bench-lm", "kv_cache_memory": KV_BUDGET, "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS, "bytes_per_token": shape.bytes_per_token, "requests": REQUESTS,
            "prompt_tokens": {"min": min(p.num_tokens for p in batch), "max": max(p.num_tokens for p in batch),
                              "mean": round(sum(p.num_tokens for p in batch) / len(batch))},
            "max_tokens": MAX_TOKENS, "completion_tokens": tokens, "wall_s": round(time.perf_counter() - start, 1),
            "preemptions": getattr(engine.scheduler, "num_preemptions", None),
            "peak_running": peak, "slots_in_budget_today": slots, "paged_vs_slots": round(peak / slots, 2),
            "target_paged_vs_slots_min": 8}
