"""An engine in this process, no HTTP, and the output tokens/s of prompts submitted together: what
epd_bench/spec_batch.py, epd_bench/attention_ab.py and epd_bench/fusion_ab.py compare engine settings with."""
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


AB_ENGINE = {"max_num_seqs": 64, "max_model_len": 2048, "kv_cache_memory": 1 << 30}  # each A/B engine's settings


def ab_model(args: Any) -> Path:
    """The A/B's checkpoint folder (`--model`, built if a bench preset), torch on 2 threads."""
    import torch

    from epd_models.resolve import resolve_model

    torch.set_num_threads(2)
    return Path(resolve_model(args.model))


def ab_parser(name: str, doc: str | None) -> Any:
    """The flags an engine-alone A/B takes: --model, --levels, --rounds, --prompt-len, --output-len."""
    from epd_bench.micro import parser

    p = parser(name, doc, json_help=None)
    p.add_argument("--model", default="bench-peer", help="a checkpoint dir, `demo` or a bench preset")
    p.add_argument("--levels", default="16,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    return p


def ab_rounds(engines: dict[str, Any], model: Path, args: Any) -> None:
    """Each level of `args.levels` on both engines (a, b: `engines`' order, which alternates round by round), 2
    threads, `args.rounds` times: prints both rates and a ÷ b per round; closes the engines."""
    from epd_contracts.sampling import SamplingParams

    (a, ea), (b, eb) = engines.items()
    prompts = random_prompts(model, args.prompt_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    try:
        for e in (ea, eb):  # warm
            rate(e, prompts(1), params)
        for n in (int(x) for x in args.levels.split(",")):
            for r in range(args.rounds):
                order = [(a, ea), (b, eb)] if r % 2 == 0 else [(b, eb), (a, ea)]
                got = {name: rate(e, prompts(n), params) for name, e in order}
                print(f"{n} in flight: {a} {got[a]:.1f} tok/s, {b} {got[b]:.1f}, {a} / {b} {got[a] / got[b]:.2f}",
                      flush=True)
    finally:
        ea.close()
        eb.close()
