"""An engine in this process, no HTTP, and the output tokens/s of prompts submitted together: what
epd_bench/spec_batch.py and epd_bench/attention_ab.py compare engine settings with."""
from __future__ import annotations

import asyncio
import time
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
