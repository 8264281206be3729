"""An attack on one decoder engine and a victim beside it, in this process (tiny model, no HTTP): when the
victim's first token came, what the attackers had (not) been given, and every stream's events."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from decoder_service.engine.sequence import Job
from decoder_service.prompt import Prompt
from decoder_service.request import Work
from decoder_service.shell import Engine
from epd_contracts.sampling import SamplingParams
from tests.decoder_service.engine_run import Result, collect

MEMORY_BOUND = 64 << 20  # RSS growth allowed over an attack (measured: a few MiB)


@dataclass
class AttackRun:
    victim: Result
    attackers: list[Result]  # every event of each attacking request (its n choices interleaved)
    done_choices_at_first_token: int  # attackers' choices already `done` when the victim's first token came
    unadmitted_at_first_token: int  # attacking requests not given a row yet then


def attack(engine: Engine, attackers: list[tuple[Prompt, SamplingParams]], victim: tuple[Prompt, SamplingParams],
           client: str = "attacker", started: int = 1) -> AttackRun:
    """Submit the attackers (one client), wait until `started` sequences run (or, with a small pool, preemption
    began: started=0), then the victim (another client); collect everything."""

    async def main() -> AttackRun:
        jobs = [engine.submit(Work(p, s, client=client)) for p, s in attackers]

        async def underway() -> None:
            while (engine.num_running < started if started else engine.scheduler.num_preempted == 0):
                await asyncio.sleep(0.005)

        await asyncio.wait_for(underway(), 60)
        victim_job = engine.submit(Work(*victim, client="victim"))
        first = await asyncio.wait_for(victim_job.events.get(), 120)
        finished = sum(_done_so_far(j) for j in jobs)
        unadmitted = sum(1 for j in jobs if not j.admitted)
        rest = await collect(victim_job, 120)
        rest.events.insert(0, first)
        rest.text = first.text + rest.text
        results = [await _all_choices(j) for j in jobs]
        return AttackRun(rest, results, finished, unadmitted)

    return asyncio.run(main())


def _done_so_far(job: Job) -> int:
    """`done` events already queued for the job (read without taking them)."""
    return sum(1 for e in list(job.events._queue) if e.type == "done")  # type: ignore[attr-defined]


async def _all_choices(job: Job) -> Result:
    out = Result()
    left = job.params.n
    while left:
        event = await asyncio.wait_for(job.events.get(), 120)
        out.events.append(event)
        if event.type == "error":
            return out
        left -= event.type == "done"
    return out


def run_alone(engine: Engine, prompt: Prompt, params: SamplingParams) -> Result:
    """One request alone, every choice's events."""

    async def main() -> Result:
        return await _all_choices(engine.submit(prompt, params))

    return asyncio.run(main())
