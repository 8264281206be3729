"""An encoder's images per second under concurrent single-image requests: the encode scheduler batching across
requests against the same scheduler running one image per forward (what the encoder did before), side by side.

    python -m epd_bench.encoder_batching [--model bench] [--concurrency 16] [--rounds 4] [--device cpu] [--json]

In this process: the model's vision half, the real `EncodeScheduler` over a `CachingEncoder` (the encoder worker's
algorithm, with an in-memory store), and `concurrency` requests of one new image each submitted at once per round
(distinct random images, decoded before they queue as the server does). Rounds alternate batched and unbatched;
each system's images per second is the median over its rounds. The batch sizes reached come from the scheduler's
own statistics.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from typing import TYPE_CHECKING, Any

from epd_bench.micro import emit, parser

if TYPE_CHECKING:  # the run imports them (torch and the encoder), after --help has answered
    from PIL import Image

    from epd_models.halves import VisionHalf


def images(n: int, seed: int, size: int) -> list[Image.Image]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


async def round_of(vision: VisionHalf, batch_items: int, concurrency: int, seed: int, size: int) -> dict[str, Any]:
    from decoder_service.aggregated import InlineCache
    from encoder_service.encode_scheduler import BatchStats, EncodeScheduler
    from epd_models.encode import CachingEncoder, ImageJob

    encoder = CachingEncoder(vision, InlineCache(1 << 34))
    stats: list[BatchStats] = []
    sched = EncodeScheduler(encoder.run, max_batch_items=batch_items, max_batch_tokens=1 << 30,
                            batches_exactly=vision.batches_exactly, on_batch=stats.append)
    jobs = [ImageJob(f"{seed}-{i}", im) for i, im in enumerate(images(concurrency, seed, size))]
    cost = vision.image_tokens((size, size))
    start = time.perf_counter()
    await asyncio.gather(*(sched.submit(f"r{i}", [(job, cost)]) for i, job in enumerate(jobs)))
    seconds = time.perf_counter() - start
    sched.shutdown()
    return {"images_per_s": concurrency / seconds, "batch_sizes": [s.items for s in stats]}


def run(model: str, concurrency: int, rounds: int, size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    from epd_models.halves import VisionHalf
    from epd_models.resolve import resolve_model

    vision = VisionHalf(resolve_model(model), device=device)
    asyncio.run(round_of(vision, 1, 2, 10**9, size))  # warm-up: first-call allocations, the processor's caches
    runs: dict[str, list[dict[str, Any]]] = {"batched": [], "unbatched": []}
    for r in range(rounds):
        order = ("batched", "unbatched") if r % 2 == 0 else ("unbatched", "batched")
        for system in order:
            items = concurrency if system == "batched" else 1
            runs[system].append(asyncio.run(round_of(vision, items, concurrency, 1000 * r + len(runs[system]), size)))
    rate = {s: statistics.median(x["images_per_s"] for x in v) for s, v in runs.items()}
    return {"model": model, "device": str(vision.device), "concurrency": concurrency, "rounds": rounds, "image_size": size,
            "threads": torch.get_num_threads(), "images_per_s": rate,
            "batched_vs_unbatched": rate["batched"] / rate["unbatched"],
            "batch_sizes": sorted({b for x in runs["batched"] for b in x["batch_sizes"]}),
            "rounds_images_per_s": {s: [round(x["images_per_s"], 2) for x in v] for s, v in runs.items()}}


def main(argv: list[str] | None = None) -> None:
    p = parser("encoder_batching", __doc__)
    p.add_argument("--model", default="bench")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (cuda if available)")
    args = p.parse_args(argv)
    emit(run(args.model, args.concurrency, args.rounds, args.image_size, args.device), args.json, text, indent=1)


def text(out: dict[str, Any]) -> str:
    rates = [f"  {system:9s} {rate:7.2f} images/s  rounds {out['rounds_images_per_s'][system]}"
             for system, rate in out["images_per_s"].items()]
    return "\n".join([f"{out['model']}: {out['concurrency']} concurrent single-image requests, {out['threads']} threads",
                      *rates, f"  batched / unbatched: {out['batched_vs_unbatched']:.2f} (batch sizes {out['batch_sizes']})"])


if __name__ == "__main__":
    main()
