"""An engine in this process, no HTTP, and the output tokens/s of prompts submitted together: what
epd_bench/spec_batch.py and epd_bench/attention_ab.py compare engine settings with."""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def engine(lm: Any, **cfg: Any) -> Any:
    """A decoder engine on `lm` with DecoderConfig(**cfg)."""
    from prometheus_client import CollectorRegistry

    from connector.tensors.consumer import ECConsumer
    from decoder_service.config import DecoderConfig
    from decoder_service.metrics import DecoderMetrics
    from decoder_service.shell import Engine

    consumer = ECConsumer()
    return Engine(lm, consumer, DecoderConfig(**cfg), DecoderMetrics(CollectorRegistry(), consumer.stats))


def rate(engine: Any, prompts: list[Any], params: Any) -> float:
    """Output tokens/s of all prompts submitted at once (`params.max_tokens` each, `ignore_eos`)."""
    async def main() -> None:
        jobs = [engine.submit(p, params) for p in prompts]
        for job in jobs:
            while (await job.events.get()).type == "delta":
                pass

    start = time.perf_counter()
    asyncio.run(main())
    return len(prompts) * params.max_tokens / (time.perf_counter() - start)


def random_prompts(model: Path, prompt_len: int, seed: int = 0) -> Callable[[int], list[Any]]:
    """A maker of n prompts of `prompt_len` random token ids of `model`'s tokenizer that are not special tokens (an
    image placeholder would want an image), new on every call."""
    import torch

    from decoder_service.engine.work import Prompt
    from epd_bench.lm_export import prompt_token_ids

    ids, draw = prompt_token_ids(model), random.Random(seed)
    return lambda n: [Prompt(torch.tensor([draw.choices(ids, k=prompt_len)]), []) for _ in range(n)]
