"""One request with n = --max-num-seqs does not shut everyone else out of a decoder.

Its n choices are sequences admitted as rows free up, at most --max-seqs-per-request (half the rows by default) at
once; a victim coming while it runs gets a row at once, with exactly the answer it gets alone, while the attacker
still runs; the attacker's choices are what they are when all n run together; memory stays bounded. A stream
queued for a row is not silent (keep-alive lines), so the proxy's --worker-timeout never takes a queue for a dead
decoder. n above --max-num-seqs is a 400 naming it, before anything runs.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from decoder_service.config import DecoderConfig
from decoder_service.shell import Engine
from decoder_service.state import DecoderState
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf
from tests.decoder_service.conftest import served
from tests.decoder_service.engine_run import greedy, make_engine, run, text_prompt
from tests.hostile.engine_attack import MEMORY_BOUND, attack, run_alone
from tests.hostile.memory import rss_bytes

N = 8


@pytest.fixture(scope="module")
def engine(tiny_model_dirs: dict[str, Path]) -> Iterator[Engine]:
    eng = make_engine(tiny_model_dirs["llava"], max_num_seqs=N)
    yield eng
    eng.close()


def attacker(engine: Engine) -> SamplingParams:
    return SamplingParams(n=N, max_tokens=120, temperature=1.0, seed=3, ignore_eos=True)


def test_a_victim_runs_beside_a_request_for_every_row(engine: Engine, tiny_model_dirs: dict[str, Path]) -> None:
    assert engine.scheduler.share == N // 2
    prompt, victim = text_prompt(engine, 4), (text_prompt(engine, 2), greedy(8))
    [solo] = run(engine, [victim])
    before = rss_bytes()
    got = attack(engine, [(prompt, attacker(engine))], victim, started=N // 2)
    assert got.victim.ok and got.victim.answer() == solo.answer()
    assert got.done_choices_at_first_token < N  # not queued behind the whole request
    assert engine.scheduler.peak_running <= N // 2 + 1  # the attacker never held more than its share
    assert rss_bytes() - before < MEMORY_BOUND
    [result] = got.attackers
    dones = {e.index: e for e in result.events if e.type == "done"}
    assert sorted(dones) == list(range(N)) and all(e.finish_reason == "length" for e in dones.values())
    together = make_engine(tiny_model_dirs["llava"], lm=engine.lm, max_num_seqs=N, max_seqs_per_request=N)
    try:  # admitted in waves, each choice is what it is when all n run at once
        alone = run_alone(together, prompt, attacker(engine))
    finally:
        together.close()
    assert {i: _text(result.events, i) for i in range(N)} == {i: _text(alone.events, i) for i in range(N)}


def _text(events: list, index: int) -> str:  # type: ignore[type-arg]
    return "".join(e.text for e in events if e.type == "delta" and e.index == index)


@pytest.fixture(scope="module")
def one_row(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[str, DecoderState]]:
    with served(DecoderConfig(max_num_seqs=1, max_model_len=512), LanguageHalf(tiny_model_dirs["llava"])) as out:
        yield out


def test_a_stream_queued_for_a_row_sends_keep_alive_lines(one_row: tuple[str, DecoderState],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The only row is held (the engine paused mid-request); the queued stream gets empty lines, not silence."""
    url, state = one_row
    assert state.engine is not None
    engine, paused, release = state.engine, threading.Event(), threading.Event()
    step = Engine.step

    def held(self: Engine) -> None:
        if self.num_running:
            paused.set()
            release.wait(60)
        step(self)

    monkeypatch.setattr(Engine, "step", held)
    body = {"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 4, "ignore_eos": True}}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{url}/generate", json=body) as holder:
            assert paused.wait(30) and engine.num_running == 1
            with client.stream("POST", f"{url}/generate", json=body) as queued:
                assert queued.status_code == 200
                lines = queued.iter_lines()
                assert next(lines) == ""  # a keep-alive while it waits for the row
                release.set()
                events = [json.loads(line) for line in lines if line]
            assert events[-1]["type"] == "done"
            assert [json.loads(line) for line in holder.iter_lines() if line][-1]["type"] == "done"


def test_n_above_max_num_seqs_is_a_400_naming_it(one_row: tuple[str, DecoderState]) -> None:
    url, _ = one_row
    body = {"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 4, "n": 2}}
    resp = httpx.post(f"{url}/generate", json=body, timeout=30)
    assert resp.status_code == 400 and "--max-num-seqs (1)" in resp.json()["error"]["message"]
    assert resp.json()["error"]["param"] == "n"
