"""How many sequences a 1 GiB K/V budget runs at once: the paged engine against the preallocated slots it replaced.

On `bench-lm` (epd_builders/bench_model.py: 8-layer Llama, hidden 512, 2 K/V heads of 64, float32: 8 KiB of K/V
per token) with `kv_cache_memory=1 GiB`, `max_model_len=8192`, `max_num_seqs=256`: `REQUESTS` text prompts of 200
to 1,500 tokens (uniform, seeded) are submitted at once, `MAX_TOKENS` greedy new tokens each (EOS ignored), far
more than the pool holds, with `max_prefill_tokens=2048` (below); the engine's `scheduler.peak_running` is the most
sequences it ran at once, read when the first request completes or the pool runs dry, where the run stops. The slot
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

from decoder_service.config import DecoderConfig
from decoder_service.engine.kv_shape import KVShape
from decoder_service.prompt import Prompt
from decoder_service.shell import Engine
from epd_bench.micro import decoder_engine
from epd_builders.bench_model import BENCH_LM_SPEC, ensure_bench_model
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf

KV_BUDGET = 1 << 30
MAX_MODEL_LEN, MAX_NUM_SEQS = 8192, 256
REQUESTS, MAX_TOKENS, PROMPT_TOKENS = 192, 96, (200, 1500)
PREFILL_TOKENS = 2048  # prompt tokens per step while others decode: the step's whole token budget (the default
# 32 starts one long prompt per 27 steps, so the first ones finish before the pool fills: the number then
# measures the prefill rate, not the memory)


def prompts(lm: LanguageHalf, n: int, seed: int = 0) -> list[Prompt]:
    """n prompts of ordinary (non-special) token ids, each of a length drawn from PROMPT_TOKENS."""
    rng = random.Random(seed)
    special = set(lm.tokenizer.all_special_ids)
    ordinary = [i for i in range(len(lm.tokenizer)) if i not in special and i != lm.image_token_id]
    return [Prompt(input_ids=torch.tensor([[rng.choice(ordinary) for _ in range(rng.randint(*PROMPT_TOKENS))]]),
                   images=[]) for _ in range(n)]


async def drive(engine: Engine, batch: list[Prompt]) -> int:
    """Submit every prompt at once; once the first request completes or the pool runs dry (a preemption), every
    request is cancelled: the most sequences at once is reached by then (admission outpaces completion here,
    2048 prompt tokens a step against 96 new tokens a request; later admissions only replace finished ones)."""
    jobs = [engine.submit(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)) for p in batch]
    first_done = asyncio.Event()

    async def one(job: Any) -> int:
        while (event := await job.events.get()).type == "delta":
            pass
        first_done.set()
        assert event.type == "done" and event.usage is not None, event
        return int(event.usage.completion_tokens)

    tasks = [asyncio.create_task(one(j)) for j in jobs]
    while engine.scheduler.num_preempted == 0 and not first_done.is_set():
        await asyncio.sleep(0.05)
    for job in jobs:
        job.cancelled.set()
    # running requests end with `done` (abort); waiting ones leave the queue with no event (their client is
    # gone, as in the server): wait for the engine to be idle, then stop listening
    while not engine.scheduler.is_idle or engine.num_waiting:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    return sum(n for n in done if isinstance(n, int))


def run_memory() -> dict[str, Any]:
    if importlib.util.find_spec("decoder_service.engine.block_manager") is None:
        return {"skipped": "this tree's engine has no K/V block pool"}  # it would preallocate 256 x 8192 positions
    lm = LanguageHalf(ensure_bench_model(BENCH_LM_SPEC, "bench-lm"))
    shape = KVShape.of(lm.config.get_text_config(), next(lm.module.parameters()).dtype)
    cfg = DecoderConfig(kv_cache_memory=KV_BUDGET, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                        max_prefill_tokens=PREFILL_TOKENS)
    engine = decoder_engine(lm, cfg, cache_bytes=0)
    batch = prompts(lm, REQUESTS)
    start = time.perf_counter()
    try:
        tokens = asyncio.run(drive(engine, batch))
    finally:
        engine.close()
        engine.consumer.close()
    slots = KV_BUDGET // (MAX_MODEL_LEN * shape.bytes_per_token)
    peak = engine.scheduler.peak_running
    return {"model": "bench-lm", "kv_cache_memory": KV_BUDGET, "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS, "bytes_per_token": shape.bytes_per_token, "requests": REQUESTS,
            "prompt_tokens": {"min": min(p.num_tokens for p in batch), "max": max(p.num_tokens for p in batch),
                              "mean": round(sum(p.num_tokens for p in batch) / len(batch))},
            "max_tokens": MAX_TOKENS, "completion_tokens_before_stop": tokens, "wall_s": round(time.perf_counter() - start, 1),
            "preemptions": engine.scheduler.num_preempted, "max_prefill_tokens": PREFILL_TOKENS,
            "num_blocks": engine.plan.num_blocks, "block_size": cfg.block_size,
            "peak_running": peak, "slots_in_budget_today": slots, "paged_vs_slots": round(peak / slots, 2),
            "target_paged_vs_slots_min": 8}
