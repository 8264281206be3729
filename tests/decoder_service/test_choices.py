"""n > 1: n choices of one prompt from one prefill, each its own stream (index), seed and slot."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from decoder_service.engine.sequence import Job, Sequence
from decoder_service.prompt import Prompt
from decoder_service.shell import Engine
from decoder_service.state import DecoderState
from epd_common.errors import APIError
from epd_contracts.generate import Event, GenerateRequest
from epd_contracts.sampling import SamplingParams
from tests.decoder_service.engine_run import greedy, make_engine, text_prompt, wait_until


@dataclass
class Choices:
    texts: dict[int, str] = field(default_factory=dict)
    done: dict[int, Event] = field(default_factory=dict)
    errors: list[Event] = field(default_factory=list)


async def collect_all(job: Job, timeout: float = 60.0) -> Choices:
    """Every event of a job until its n dones or its error (what the server streams)."""
    out = Choices()
    while len(out.done) < job.params.n and not out.errors:
        event = await asyncio.wait_for(job.events.get(), timeout)
        if event.type == "error":
            out.errors.append(event)
        elif event.type == "done":
            assert event.index not in out.done, "one done per choice"
            out.done[event.index] = event
        else:
            out.texts[event.index] = out.texts.get(event.index, "") + event.text
    return out


def run_jobs(engine: Engine, specs: list[tuple[Prompt, SamplingParams]]) -> list[Choices]:
    async def main() -> list[Choices]:
        jobs = [engine.submit(prompt, params) for prompt, params in specs]
        return list(await asyncio.gather(*(collect_all(job) for job in jobs)))

    return asyncio.run(main())


@pytest.fixture
def engine(tiny_model_dirs: dict[str, Path]) -> Iterator[Engine]:
    eng = make_engine(tiny_model_dirs["llava"])
    yield eng
    eng.close()


def test_n_greedy_choices_are_identical_and_equal_to_one_choice(engine: Engine) -> None:
    prompt = text_prompt(engine, 4)
    [three], [one] = run_jobs(engine, [(prompt, greedy(10, n=3))]), run_jobs(engine, [(prompt, greedy(10))])
    assert sorted(three.done) == [0, 1, 2] and not three.errors
    assert three.texts[0] == three.texts[1] == three.texts[2] == one.texts[0] != ""
    assert all(e.usage is not None and e.usage.completion_tokens == 10 for e in three.done.values())


def test_seeded_choices_are_reproducible_and_choice_i_is_a_single_request_with_its_seed(engine: Engine) -> None:
    prompt = text_prompt(engine, 4)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, n=3, ignore_eos=True)
    first, second = run_jobs(engine, [(prompt, params)] * 2)
    assert first.texts == second.texts and len(set(first.texts.values())) > 1  # the tiny model is random: choices differ
    singles = run_jobs(engine, [(prompt, SamplingParams(max_tokens=12, seed=params.choice_seed(i), ignore_eos=True))
                                for i in range(3)])
    assert [s.texts[0] for s in singles] == [first.texts[i] for i in range(3)]


def test_n_choices_prefill_the_prompt_once(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    positions: list[int] = []  # tokens through each forward
    forward = engine.lm.forward_rows

    def counting(embeds: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        positions.append(embeds.shape[0] * embeds.shape[1])
        return forward(embeds, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.lm, "forward_rows", counting)
    prompt, n, max_tokens = text_prompt(engine, 6), 4, 8
    [out] = run_jobs(engine, [(prompt, greedy(max_tokens, n=n))])
    assert len(out.done) == n
    decoded = n * (max_tokens - 1)  # each choice feeds back every token but its last
    assert sum(positions) - decoded == prompt.num_tokens == engine.runner.num_prefilled_tokens


def test_n_above_max_num_seqs_is_refused_naming_n(engine: Engine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(APIError) as err:
        engine.prepare(GenerateRequest(messages=messages, sampling=SamplingParams(n=engine.cfg.max_num_seqs + 1)))
    assert err.value.status == 400 and err.value.param == "n"


def test_one_failing_choice_ends_the_job_with_one_error_and_frees_every_slot(engine: Engine,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    new_sequence = engine.scheduler.new_sequence

    def fragile(job: Job, index: int) -> Sequence:
        seq = new_sequence(job, index)
        if index == 1 and job.params.max_tokens == 30:
            def broken(logits: torch.Tensor) -> torch.Tensor:
                raise RuntimeError("choice 1 breaks")
            monkeypatch.setattr(seq.sampler, "choose", broken)
        return seq

    monkeypatch.setattr(engine.scheduler, "new_sequence", fragile)
    prompt = text_prompt(engine, 3)
    failed, bystander = run_jobs(engine, [(prompt, greedy(30, n=3)), (prompt, greedy(20))])
    assert len(failed.errors) == 1 and not failed.done
    assert sorted(bystander.done) == [0] and bystander.done[0].finish_reason == "length"
    assert wait_until(lambda: engine.num_running == 0)
    assert engine.runner.rows == {} and engine.runner.num_free_blocks == engine.runner.blocks.num_usable and engine.scheduler.keys == {} and engine.runner.num_free_slots == 8


def test_a_cancelled_job_frees_every_slot(engine: Engine) -> None:
    async def main() -> None:
        job = engine.submit(text_prompt(engine, 3), greedy(200, n=3))
        assert (await job.events.get()).type == "delta"
        job.cancelled.set()
        await asyncio.to_thread(wait_until, lambda: engine.scheduler.finished["abort"] == 3)

    asyncio.run(main())
    assert engine.runner.rows == {} and engine.runner.num_free_blocks == engine.runner.blocks.num_usable and engine.num_running == 0 and engine.runner.num_free_slots == 8


def test_a_job_holds_its_share_of_rows_and_its_other_choices_follow(tiny_model_dirs: dict[str, Path]) -> None:
    """n = 3 with --max-num-seqs 4 (a share of 2): two choices run beside the other request, the third once one of
    them ends, from a prompt prefilled again (the prefix cache's blocks); every choice is the greedy answer."""
    engine = make_engine(tiny_model_dirs["llava"], max_num_seqs=4)
    try:
        assert engine.scheduler.share == 2
        prompt = text_prompt(engine, 3)
        one, three = run_jobs(engine, [(prompt, greedy(6)), (prompt, greedy(6, n=3))])
        assert sorted(three.done) == [0, 1, 2] and set(three.texts.values()) == {one.texts[0]} and one.done
        assert engine.scheduler.peak_running == 3  # 1 + the job's share, never 4
    finally:
        engine.close()


def test_the_stream_ends_after_every_choice_is_done(decoder: tuple[str, DecoderState]) -> None:
    url, _ = decoder
    body = {"messages": [{"role": "user", "content": "hi"}],
            "sampling": {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 3}}
    lines = [json.loads(line) for line in httpx.post(f"{url}/generate", json=body, timeout=60).text.splitlines()
             if line]  # empty: a keep-alive
    dones = [e for e in lines if e["type"] == "done"]
    assert sorted(e.get("index", 0) for e in dones) == [0, 1, 2] and lines[-1]["type"] == "done"
