"""Where a level's time goes in the engine alone (no HTTP): each step's forward timed, as prefill steps (a prompt
chunk in them) and decode-only steps, under each prefill split: the runner's (`runner`: parts of at least an eighth
of the step's budget, short rests first, decoder_service/engine/fairness.py), the equal split it had before
(`equal`: the budget shared equally between every prompt prefilling, at least a block each) and first come, first
served (`fcfs`: each prompt in admission order takes what it can, as vLLM's chunked prefill does). Only this
benchmark runs the last two.

    python -m epd_bench.step_times [--model bench-peer] [--in-flight 64] [--rounds 2] [--splits runner,equal,fcfs]
                                   [--prompt-len 256] [--output-len 128] [--profile-step N]

One engine, 2 threads, 1 GiB of K/V, at most 64 sequences; prompts of random token ids that are not special tokens
(new every run), greedy, `ignore_eos`, all submitted together; each round runs every split in turn. Prints a line per
(round, split): output tokens/s, the prefill steps (count, seconds, mean) and the decode-only steps (count, seconds,
mean). `--profile-step N`: torch.profiler's top operators of the first round's N-th step (docs/BENCHMARKS.md, "Where a
64-in-flight level's time goes").
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

from epd_bench.engine_alone import engine, random_prompts, rate
from epd_bench.micro import parser


def first_come_first_served(limits: Mapping[Hashable, int], budget: int, floor: int) -> dict[Hashable, int]:
    """split_prefill_budget's signature: each prompt, in admission order, takes what it may of what is left."""
    grant: dict[Hashable, int] = {}
    for key, limit in limits.items():
        if budget <= 0:
            break
        grant[key] = min(limit, budget)
        budget -= grant[key]
    return grant


def equal_parts(limits: Mapping[Hashable, int], budget: int, floor: int) -> dict[Hashable, int]:
    """The runner's split before parts had a floor of an eighth of the budget: an equal part each (at least `floor`),
    then what some cannot use to the others, all in admission order."""
    if budget <= 0 or not limits:
        return {}
    share = max(floor, -(-budget // len(limits)))
    grant: dict[Hashable, int] = {}
    for key, limit in limits.items():
        grant[key] = min(limit, share, budget)
        budget -= grant[key]
    for key, limit in limits.items():
        more = min(limit - grant[key], budget)
        grant[key] += more
        budget -= more
    return grant


def timed_steps(runner: Any, profile_step: int) -> tuple[Callable[[], dict[str, list[float]]], Any]:
    """Wrap `runner.run`: each call's seconds under "prefill" or "decode"; returns (take the times so far, profiler)."""
    import torch

    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    run, calls = runner.run, [0]  # calls: steps since wrapping
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile_step else None

    def wrapped(scheduled: Any) -> Any:
        calls[0] += 1
        prefilling = any(not r.prefilled for r in runner.rows.values())
        start = time.perf_counter()
        if prof is not None and calls[0] == profile_step:
            with prof:
                out = run(scheduled)
        else:
            out = run(scheduled)
        times["prefill" if prefilling else "decode"].append(time.perf_counter() - start)
        return out

    def take() -> dict[str, list[float]]:
        got = {k: list(v) for k, v in times.items()}
        for v in times.values():
            v.clear()
        return got

    runner.run = wrapped
    return take, prof


def main(argv: list[str] | None = None) -> None:
    p = parser("step_times", __doc__, json_help=None)
    p.add_argument("--model", default="bench-peer", help="a checkpoint dir, `demo` or a bench preset")
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--splits", default="runner,equal,fcfs")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--profile-step", type=int, default=0, help="profile the first round's N-th step (0: none)")
    args = p.parse_args(argv)
    import torch

    import decoder_service.engine.model_runner as model_runner
    from epd_contracts.sampling import SamplingParams
    from epd_models.halves import LanguageHalf
    from epd_models.resolve import resolve_model

    runner_split = model_runner.split_prefill_budget
    splits = {"runner": runner_split, "equal": equal_parts, "fcfs": first_come_first_served}
    chosen = args.splits.split(",")
    if not chosen or any(s not in splits for s in chosen):
        p.error(f"--splits: a comma-separated list of {', '.join(splits)}")
    torch.set_num_threads(2)
    model = Path(resolve_model(args.model))
    lm = LanguageHalf(model, dtype="float32")
    prompts = random_prompts(model, args.prompt_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    e = engine(lm, max_num_seqs=64, max_model_len=2048, kv_cache_memory=1 << 30)

    try:
        rate(e, prompts(1), params)  # warm
        take, prof = timed_steps(e.runner, args.profile_step)
        for r in range(args.rounds):
            for name in chosen:
                model_runner.split_prefill_budget = splits[name]
                try:
                    tok_s = rate(e, prompts(args.in_flight), params)
                finally:
                    model_runner.split_prefill_budget = runner_split
                got = take()
                parts = [f"{kind} {len(t)} steps {sum(t):.2f} s ({sum(t) / len(t) * 1e3:.1f} ms each)"
                         for kind, t in got.items() if t]
                print(f"round {r} {name}: {tok_s:.1f} tok/s; {'; '.join(parts)}", flush=True)
        if prof is not None and prof.profiler is not None:  # the step was reached
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    finally:
        e.close()


if __name__ == "__main__":
    main()
