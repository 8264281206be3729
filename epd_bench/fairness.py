"""A victim's time to first token on one decoder engine while another client attacks it (fair admission of n > 1 and of many long requests).

    python -m epd_bench.fairness [--json] [--deadline 120]

Each scenario runs the demo model's decoder engine in this process (no HTTP): the victim's short request alone,
then the same request submitted once the attack is running. `n`: one request with n = --max-num-seqs and long
max_tokens (every row); `admission`: 24 long requests of one client (its cache_salt) on a pool of a few sequences'
blocks, so they preempt each other. A victim with no first token within --deadline is reported as that many
seconds and `starved`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from epd_bench.micro import decoder_engine

if TYPE_CHECKING:
    from decoder_service.engine.sequence import Job
    from decoder_service.shell import Engine
    from epd_contracts.generate import GenerateRequest
    from epd_contracts.sampling import SamplingParams
    from epd_models.halves import LanguageHalf

SCENARIOS: dict[str, dict[str, Any]] = {
    # one request takes every row for long
    "n": {"cfg": {"max_num_seqs": 8}, "attackers": 1, "n": 8, "words": 4, "max_tokens": 400},
    # 24 long requests of one client on a pool of about 4 sequences' blocks
    "admission": {"cfg": {"max_num_seqs": 32}, "attackers": 24, "n": 1, "words": 12,
                  "max_tokens": 160, "pool_sequences": 4},
}


def _request(words: int, params: SamplingParams, salt: str) -> GenerateRequest:
    from epd_contracts.generate import GenerateRequest

    text = " ".join(["tell me a long story about the sea"] * words)
    return GenerateRequest(messages=[{"role": "user", "content": text}], sampling=params, cache_salt=salt)


def _engine(lm: LanguageHalf, cfg: dict[str, Any], pool_sequences: int = 0) -> Engine:
    from decoder_service.config import DecoderConfig
    from decoder_service.engine.kv_shape import KVShape

    base = {"max_model_len": 512, "max_prefill_tokens": 32, **cfg}
    if pool_sequences:  # blocks for about this many sequences of max_model_len (a small pool)
        shape = KVShape.of(lm.config.get_text_config(), next(lm.module.parameters()).dtype)
        base["kv_cache_memory"] = pool_sequences * base["max_model_len"] * shape.bytes_per_token
    return decoder_engine(lm, DecoderConfig(**base))


async def _first_token(job: Job, deadline: float) -> float | None:
    start = time.perf_counter()
    try:
        while True:
            event = await asyncio.wait_for(job.events.get(), deadline - (time.perf_counter() - start))
            if event.type == "delta" and event.text:
                return time.perf_counter() - start
            if event.type != "delta":
                raise RuntimeError(f"the victim's stream ended before its first token: {event}")
    except TimeoutError:
        return None


async def _victim(engine: Engine, deadline: float) -> float | None:
    from epd_contracts.sampling import SamplingParams

    work = await asyncio.to_thread(engine.prepare, _request(2, SamplingParams(max_tokens=4, temperature=0,
                                                                               ignore_eos=True), "victim"))
    job = engine.submit(work)
    try:
        return await _first_token(job, deadline)
    finally:
        job.cancelled.set()


def _underway(engine: Engine, spec: dict[str, Any]) -> bool:
    """The attack holds rows (and, on a small pool, its requests preempt each other)."""
    return engine.num_running > 0 and (not spec.get("pool_sequences") or engine.scheduler.num_preempted > 0)


async def _scenario(engine: Engine, spec: dict[str, Any], deadline: float) -> dict[str, Any]:
    from epd_contracts.sampling import SamplingParams

    alone = await _victim(engine, deadline)
    params = SamplingParams(n=spec["n"], max_tokens=spec["max_tokens"], temperature=1.0, seed=1, ignore_eos=True)
    works = [await asyncio.to_thread(engine.prepare, _request(spec["words"], params, "attacker"))
             for _ in range(spec["attackers"])]
    jobs = [engine.submit(w) for w in works]
    until = time.monotonic() + deadline
    while not _underway(engine, spec) and time.monotonic() < until:  # the attack holds rows before the victim comes
        await asyncio.sleep(0.01)
    during = await _victim(engine, deadline)
    preempted = engine.scheduler.num_preempted  # by the victim's first token
    for job in jobs:
        job.cancelled.set()
    while not engine.scheduler.is_idle and time.monotonic() < until + deadline:  # every row given back
        await asyncio.sleep(0.01)
    return {"victim_ttft_alone_s": alone, "victim_ttft_during_s": during if during is not None else deadline,
            "starved": during is None, "preemptions": preempted}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds a victim waits for its first token")
    p.add_argument("--only", choices=sorted(SCENARIOS), help="run one scenario")
    args = p.parse_args()
    from epd_models.halves import LanguageHalf
    from epd_models.resolve import resolve_model

    lm = LanguageHalf(resolve_model("demo"))
    out: dict[str, Any] = {}
    for name, spec in SCENARIOS.items():
        if args.only and name != args.only:
            continue
        engine = _engine(lm, spec["cfg"], spec.get("pool_sequences", 0))
        try:
            out[name] = asyncio.run(_scenario(engine, spec, args.deadline))
        finally:
            engine.close()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, r in out.items():
            print(f"{name:10s} victim TTFT alone {r['victim_ttft_alone_s']:.3f} s, during the attack "
                  f"{'>' if r['starved'] else ''}{r['victim_ttft_during_s']:.3f} s ({r['preemptions']} preemptions)")


if __name__ == "__main__":
    main()
