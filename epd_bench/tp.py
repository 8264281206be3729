"""Tensor parallelism on the CPU: output tokens/s and TPOT of one decoder engine at --tensor-parallel-size 2 (rank 0
pinned to core 0, rank 1 to core 1, one thread each) against size 1 on one core and on both (two threads), on the
same requests, in alternating rounds; and rank 0's communication per step (the step's broadcast plus the layers'
all-reduces, gloo over loopback: time in an all-reduce includes waiting for the other rank to reach it), beside a bare
gloo all-reduce of one decode step's hidden states between two pinned processes (the transport alone).

    python -m epd_bench.tp [--model bench-lm] [--requests 8] [--max-tokens 48] [--rounds 2]
"""
from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from epd_bench.micro import decoder_engine, emit, parser


def pin(cpus: set[int], pid: int | None = None) -> None:
    """Every thread of the process `pid` (this one by default) onto `cpus`."""
    for tid in os.listdir(f"/proc/{pid or os.getpid()}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that just ended


def one_round(lm: Any, requests: int, max_tokens: int) -> dict[str, float]:
    from decoder_service.config import DecoderConfig
    from decoder_service.prompt import build_prompt
    from epd_contracts.sampling import SamplingParams
    from epd_models.chat import chat_template, render

    engine = decoder_engine(lm, DecoderConfig(max_num_seqs=requests, max_model_len=512, prefix_cache_bytes=0,
                                              kv_cache_memory=64 << 20))
    template = chat_template(lm.tokenizer, lm.model_dir)
    prompts = [build_prompt(lm, render(lm.tokenizer, [{"role": "user", "content": f"story number {i} " * 16}],
                                       template), []) for i in range(requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def run() -> tuple[float, list[float]]:
        start = time.perf_counter()
        jobs = [engine.submit(p, params) for p in prompts]

        async def times(job: Any) -> list[float]:
            out = []
            while (event := await asyncio.wait_for(job.events.get(), 600)).type == "delta":
                out.append(time.perf_counter())
            assert event.type == "done", event
            return out

        stamps = await asyncio.gather(*(times(j) for j in jobs))
        wall = time.perf_counter() - start
        return wall, [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]

    try:
        wall, tpots = asyncio.run(run())
    finally:
        engine.close()
    return {"tokens_per_s": requests * max_tokens / wall, "tpot_ms": 1e3 * statistics.mean(tpots)}


def _bare(rank: int, port: int, numel: int, iters: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    pin({rank})
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    t = torch.ones(numel)
    times = []
    for _ in range(iters + 10):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    if rank == 0:
        out.put(statistics.median(times[10:]))


def bare_all_reduce_ms(numel: int, iters: int = 200) -> float:
    """Median ms of one gloo all-reduce of `numel` float32 between two processes pinned to cores 0 and 1."""
    import multiprocessing

    from epd_launcher.group import free_port

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_bare, args=(r, port, numel, iters, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    median = float(out.get(timeout=300))
    for p in procs:
        p.join()
    return round(median * 1e3, 4)


def main(argv: list[str] | None = None) -> None:
    p = parser("tp", __doc__)
    p.add_argument("--model", default="bench-lm")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    import torch

    from decoder_service.engine.tp.load import load_language
    from epd_models.halves import LanguageHalf
    from epd_models.resolve import resolve_model
    from epd_models.tensor_parallel import CLOCK

    model = Path(resolve_model(args.model))
    one = LanguageHalf(model)
    torch.set_num_threads(2)
    two = load_language(model, dtype="auto", device="cpu", quantized="auto", size=2)  # sets 1 thread per rank
    assert two.ranks is not None
    pin({1}, two.ranks.procs[0].pid)
    rows: dict[str, list[dict[str, float]]] = {"tp1-1core": [], "tp1-2threads": [], "tp2": []}
    comm = {"steps": 0, "broadcast_s": 0.0, "all_reduce_s": 0.0, "all_reduces": 0}
    try:
        for _ in range(args.rounds):
            for name in rows:
                cores, threads = ({0, 1}, 2) if name == "tp1-2threads" else ({0}, 1)
                torch.set_num_threads(threads)
                pin(cores)
                lm = two if name == "tp2" else one
                steps, bcast, ar, calls = (two.ranks.steps, two.ranks.broadcast_s, CLOCK.seconds, CLOCK.calls)
                rows[name].append(one_round(lm, args.requests, args.max_tokens))
                if name == "tp2":
                    comm["steps"] += two.ranks.steps - steps
                    comm["broadcast_s"] += two.ranks.broadcast_s - bcast
                    comm["all_reduce_s"] += CLOCK.seconds - ar
                    comm["all_reduces"] += CLOCK.calls - calls
    finally:
        two.ranks.close()
    mean = {n: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for n, rs in rows.items()}
    steps = max(1, int(comm["steps"]))
    result = {"model": args.model, "requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
              **{n: {k: round(v, 2) for k, v in m.items()} for n, m in mean.items()},
              "tokens_per_s_tp2_over_tp1_1core": round(mean["tp2"]["tokens_per_s"] / mean["tp1-1core"]["tokens_per_s"], 3),
              "tokens_per_s_tp2_over_tp1_2threads": round(mean["tp2"]["tokens_per_s"]
                                                          / mean["tp1-2threads"]["tokens_per_s"], 3),
              "tpot_tp2_over_tp1_1core": round(mean["tp2"]["tpot_ms"] / mean["tp1-1core"]["tpot_ms"], 3),
              "comm_ms_per_step": round(1e3 * (comm["broadcast_s"] + comm["all_reduce_s"]) / steps, 3),
              "broadcast_ms_per_step": round(1e3 * comm["broadcast_s"] / steps, 3),
              "all_reduces_per_step": round(comm["all_reduces"] / steps, 1)}
    hidden = int(one.config.get_text_config().hidden_size)
    result["bare_all_reduce_ms"] = bare_all_reduce_ms(args.requests * hidden)  # one decode step's hidden states
    emit(result, args.json, indent=2)


if __name__ == "__main__":
    main()
