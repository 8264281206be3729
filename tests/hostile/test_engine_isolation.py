"""One request's failure on the engine thread ends that request alone.

For each way one request can fail on the decoder's engine thread (admission and seeding, embedding merge,
prefill, a batched decode forward, sampling, the sampler's read-back, detokenization, a slot left full of
NaN), the failing request is submitted together with two victims (one greedy, one seeded sampling), and:
- the failing request gets its own `error` event;
- both victims finish with exactly the text and token count they produce alone;
- its slot is freed, the engine reports no problem, and an ordinary request right after gets its solo answer;
- the process's RSS stays within MEMORY_BOUND of what it was before the case.
Faults are injected by bypassing validation (msgspec.structs.force_setattr) or by patching one component
so that it fails for the culprit only (marked by its seed).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import decoder_service.engine.sequence as sequence_module
from decoder_service.engine.detokenizer import IncrementalDetokenizer
from decoder_service.engine.sampling import Sampler
from decoder_service.engine.step_plan import current_plan
from decoder_service.prompt import Prompt
from decoder_service.shell import Engine
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.sampling import SamplingParams
from tests.decoder_service.engine_run import Result, greedy, make_engine, run, text_prompt
from tests.hostile.memory import rss_bytes

CULPRIT_SEED = 4242  # marks the request the injected fault hits
MEMORY_BOUND = 64 << 20  # RSS growth allowed per case (measured: under 2 MiB)


@pytest.fixture(scope="module")
def engine(tiny_model_dirs: dict[str, Path]) -> Iterator[Engine]:
    eng = make_engine(tiny_model_dirs["llava"])
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def victims(engine: Engine) -> list[tuple[Prompt, SamplingParams]]:
    # the culprit takes slot 0; when it leaves, the last victim (the shorter prompt) moves into its slot and
    # decodes beside a longer row, so it reads (masked) columns past its own length there
    return [(text_prompt(engine, 9), SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)),
            (text_prompt(engine, 3), greedy(16))]


@pytest.fixture(scope="module")
def solo(engine: Engine, victims: list[tuple[Prompt, SamplingParams]]) -> list[Result]:
    out = [run(engine, [spec])[0] for spec in victims]
    assert all(r.ok for r in out) and out[0].text != out[1].text
    return out


def culprit_params(**kw: Any) -> SamplingParams:
    return greedy(16, seed=CULPRIT_SEED, **kw)


def seed_out_of_range() -> SamplingParams:
    params = culprit_params()
    msgspec.structs.force_setattr(params, "seed", 2**64)  # past the contract's check
    return params


def is_culprit(engine: Engine, key: object) -> bool:
    seq = engine.scheduler.running.get(key)  # type: ignore[call-overload]
    return seq is not None and seq.job.params.seed == CULPRIT_SEED


def fail_forward_of_culprit(engine: Engine, monkeypatch: pytest.MonkeyPatch, decode: bool) -> None:
    """The LM forward raises whenever the culprit's row is in it (decode: from its 3rd token; else: prefill)."""
    forward = engine.lm.forward_rows

    def faulty(*args: Any, **kw: Any) -> torch.Tensor:
        plan = current_plan()
        assert plan is not None
        for group in plan.groups:
            for key in group.keys:
                if is_culprit(engine, key) and group.decode == decode:
                    row = engine.runner.rows[key]
                    if not decode or row.length > row.prompt.num_tokens + 2:
                        raise RuntimeError("injected forward failure")
        return forward(*args, **kw)

    monkeypatch.setattr(engine.lm, "forward_rows", faulty)


def chosen_before(sampler: Sampler) -> int:
    """How many times this sampler chose before this call (counted here: a sampler counts tokens only for penalties)."""
    n: int = sampler.__dict__.get("_test_calls", 0)
    sampler.__dict__["_test_calls"] = n + 1
    return n


class FaultySampler(Sampler):
    """The culprit's sampler breaks after 3 tokens: it raises, or returns something that is not a token."""

    mode = "raise"

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        if self.params.seed == CULPRIT_SEED and chosen_before(self) >= 3:
            if self.mode == "raise":
                raise RuntimeError("injected sampling failure")
            if self.mode == "float":  # would promote every row's token to float in a stacked read-back
                return torch.tensor(1.5)
            return torch.tensor([1, 2])  # not 0-d: would break the stack of every row
        return super().choose(logits)


class FaultyDetokenizer(IncrementalDetokenizer):
    def add(self, token_id: int) -> str:
        if "culprit" in self.stop and len(self.token_ids) >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return super().add(token_id)


def poison_slot_then_fail(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The K/V the culprit wrote turn NaN (as an overflowing forward would leave them), then it fails: whatever
    sequence moves into or takes that slot next must not read them, even masked (0 * NaN is NaN)."""

    class Poisoner(Sampler):
        def choose(self, logits: torch.Tensor) -> torch.Tensor:
            if self.params.seed == CULPRIT_SEED and chosen_before(self) >= 3:
                key = next(k for k in engine.runner.rows if is_culprit(engine, k))
                blocks = torch.tensor(engine.runner.rows[key].blocks)  # the culprit's prompt is the longest
                for layer in engine.runner.cache.paged_layers:
                    for pool in (layer.keys, layer.values):
                        assert pool is not None
                        pool.index_fill_(1 if engine.runner.cache.head_major else 0, blocks, float("nan"))
                raise RuntimeError("injected failure after poisoning the slot")
            return super().choose(logits)

    monkeypatch.setattr(sequence_module, "Sampler", Poisoner)


def sampler_mode(mode: str) -> Callable[[Engine, pytest.MonkeyPatch], None]:
    def install(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(FaultySampler, "mode", mode)
        monkeypatch.setattr(sequence_module, "Sampler", FaultySampler)
    return install


# name -> (install the fault, the culprit's prompt (None: a short text one), its params)
CASES: dict[str, tuple[Callable[[Engine, pytest.MonkeyPatch], None], Callable[[Engine], Prompt] | None,
                       Callable[[], SamplingParams]]] = {
    "seed_out_of_range": (lambda e, m: None, None,
                          seed_out_of_range),
    "embeddings_of_another_width": (lambda e, m: None,
                                    lambda e: text_prompt(e, 2, [ImageFeatures(embeds=torch.ones(5, 32))]),
                                    culprit_params),
    "prefill_forward_fails": (lambda e, m: fail_forward_of_culprit(e, m, decode=False), None, culprit_params),
    "batched_decode_fails": (lambda e, m: fail_forward_of_culprit(e, m, decode=True), None, culprit_params),
    "sampler_raises": (sampler_mode("raise"), None, culprit_params),
    "sampler_returns_a_float": (sampler_mode("float"), None, culprit_params),
    "sampler_returns_a_vector": (sampler_mode("vector"), None, culprit_params),
    "detokenizer_raises": (lambda e, m: m.setattr(sequence_module, "IncrementalDetokenizer", FaultyDetokenizer),
                           None, lambda: culprit_params(stop=("culprit",))),
    "slot_left_full_of_nan": (poison_slot_then_fail, None, culprit_params),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failing_request_ends_alone(engine: Engine, victims: list[tuple[Prompt, SamplingParams]],
                                      solo: list[Result], monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    install, make_prompt, make_params = CASES[case]
    before = rss_bytes()
    errors_before = engine.scheduler.finished["error"]
    install(engine, monkeypatch)
    culprit = (make_prompt(engine) if make_prompt else text_prompt(engine, 5), make_params())
    bad, *others = run(engine, [culprit, *victims])
    monkeypatch.undo()
    assert bad.last.type == "error" and bad.last.message and "generation failed" in bad.last.message
    assert [r.answer() for r in others] == [r.answer() for r in solo]
    assert engine.scheduler.finished["error"] == errors_before + 1
    assert engine.num_running == 0 and engine.runner.rows == {} and engine.runner.num_free_blocks == engine.runner.blocks.num_usable and engine.problem() is None
    # an ordinary request right after (into the slot the culprit left) gets its solo answer
    assert run(engine, [victims[0]])[0].answer() == solo[0].answer()
    assert rss_bytes() - before < MEMORY_BOUND
