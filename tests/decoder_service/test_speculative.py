"""Speculative decoding in the engine: greedy output with speculation is plain greedy output token for token, for
every family, with images in the prompt, prefix reuse, n = 2, a JSON grammar, preemption under a tiny pool and the
prefill/decode hand-off; seeded sampling is reproducible.

Most tests drive the verification with an oracle proposer (`oracle`): it proposes the plain run's own next tokens,
with one of them wrong in every other proposal, so each run keeps whole proposals, keeps part of one and rejects at
every position; the n-gram proposer's own cases are at the end."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from decoder_service.engine.sequence import Sequence
from decoder_service.engine.spec.config import SpecConfig
from decoder_service.engine.spec.propose import Speculator
from decoder_service.engine.work import Work
from decoder_service.shell import Engine
from epd_builders.eagle3 import build_eagle3
from epd_builders.tiny import FAMILIES
from epd_contracts.generate import GenerateRequest
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf
from tests.decoder_service.engine_run import Result, make_engine, run
from tests.decoder_service.test_handoff import (
    GUIDED,
    USER,
    MemoryStore,
    chain_of,
    handoff_engine,
    prefill_then_decode,
    run_one,
)
from tests.decoder_service.test_preemption import preempting_engine, prompts
from tests.decoder_service.test_tensor_parallel import tp_half

MAX_TOKENS = 20
LOGPROB_TOL = 1e-4  # measured up to ~5e-7 on the tiny models
K = 4
SPEC = SpecConfig(num_speculative_tokens=K, disable_by_batch_size=64)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


class Reference:
    """Each choice's tokens in a plain run, by (prompt ids, choice index): what the oracle proposes from."""

    def __init__(self) -> None:
        self.tokens: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self.calls = 0

    def key(self, seq: Sequence) -> tuple[tuple[int, ...], int]:
        return tuple(seq.job.prompt.input_ids[0].tolist()), seq.index


@pytest.fixture
def oracle(monkeypatch: pytest.MonkeyPatch) -> Iterator[Reference]:
    """Plain runs record every choice's tokens; speculative runs propose the recorded continuation, its
    (call % K)-th token made wrong in every other proposal (a rejection there, the drafts before it kept)."""
    ref = Reference()
    finish = Sequence.finish

    def recording(self: Sequence, reason: str) -> None:
        ref.tokens.setdefault(ref.key(self), list(self.generated))
        finish(self, reason)

    def propose(self: Speculator, seq: Sequence, k: int) -> list[int]:
        ref.calls += 1
        known = ref.tokens.get(ref.key(seq), [])
        draft = list(known[seq.num_generated: seq.num_generated + k])
        if draft and ref.calls % 2:
            i = ref.calls // 2 % len(draft)
            draft[i] = (draft[i] + 1) % 64
        return draft

    monkeypatch.setattr(Sequence, "finish", recording)
    monkeypatch.setattr(Speculator, "propose", propose)
    yield ref


Method = Callable[[Path], SpecConfig]


@pytest.fixture(params=["ngram", "draft_model", "eagle3"])
def method(request: pytest.FixtureRequest, tmp_path: Path, oracle: Reference) -> Method:
    """The feature tests run with each method: the n-gram path (proposals by the oracle), a draft model (the target
    itself: its proposals are the target's greedy tokens, which a grammar or sampling may refuse) and EAGLE-3 (tiny
    random heads: nearly every proposal rejected)."""
    name = request.param
    if name == "ngram":
        return lambda target: SPEC
    if name == "draft_model":
        return lambda target: SpecConfig(name, K, disable_by_batch_size=64, model=str(target))
    return lambda target: SpecConfig(name, K, disable_by_batch_size=64,
                                     model=str(build_eagle3(target, tmp_path / "eagle3")))


def texts(results: list[Result]) -> list[tuple[Any, ...]]:
    """Each result's answer and the tokens of its logprobs (when asked for)."""
    return [(*r.answer(), [lp.token for e in r.events for lp in e.logprobs or []]) for r in results]


def assert_same(spec: dict[int, list[Any]], plain: dict[int, list[Any]]) -> None:
    """Choice for choice, event for event: the same texts, tokens and finish; logprobs within LOGPROB_TOL (a
    verification's k + 1 rows go through the matmuls in another shape than one row, so the last bits may differ)."""
    assert spec.keys() == plain.keys()
    for i in spec:
        assert [e[:1] + e[2:] for e in _strip(spec[i])] == [e[:1] + e[2:] for e in _strip(plain[i])]
        assert [e[1] for e in spec[i]] == [e[1] for e in plain[i]]
        a = [lp for e in spec[i] for lp in e[2] or []]
        b = [lp for e in plain[i] for lp in e[2] or []]
        assert [x.token for x in a] == [x.token for x in b]
        assert all(abs(x.logprob - y.logprob) <= LOGPROB_TOL for x, y in zip(a, b, strict=True))


def _strip(events: list[Any]) -> list[Any]:
    return [(e[0], None, [lp.token for lp in e[2] or []], *e[3:]) for e in events]


def both_ways(model_dir: Path, lm: LanguageHalf, specs: list[tuple[Any, SamplingParams]], **cfg: Any
              ) -> tuple[list[Result], list[Result], Engine]:
    plain = make_engine(model_dir, lm, **{"max_model_len": 2048, **cfg})
    try:
        before = run(plain, specs)
    finally:
        plain.close()
    spec = make_engine(model_dir, lm, **{"max_model_len": 2048, "speculative_config": SPEC, **cfg})
    try:
        return before, run(spec, specs), spec
    finally:
        spec.close()


def plain_texts(model_dir: Path, lm: LanguageHalf, specs: list[tuple[Any, SamplingParams]]) -> list[Any]:
    """What the engine answers without speculation."""
    plain = make_engine(model_dir, lm, max_model_len=2048)
    try:
        return texts(run(plain, specs))
    finally:
        plain.close()


@contextmanager
def spec_engine(model_dir: Path, lm: LanguageHalf, cfg: SpecConfig, **kw: Any) -> Iterator[Engine]:
    engine = make_engine(model_dir, lm, **{"max_model_len": 2048, "speculative_config": cfg, **kw})
    try:
        yield engine
    finally:
        engine.close()


def accepted(engine: Engine) -> tuple[int, int]:
    summary = engine.spec_summary()
    assert summary is not None
    return int(summary["draft_tokens"]), int(summary["accepted_tokens"])  # type: ignore[call-overload]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_speculation_is_plain_greedy_for_every_family(tiny_model_dirs: dict[str, Path], family: str,
                                                                  oracle: Reference) -> None:
    lm = LanguageHalf(tiny_model_dirs[family])
    ps = prompts(tiny_model_dirs[family], lm)
    specs = [(ps[0], GREEDY), (ps[-1], GREEDY), (ps[-1], msgspec.structs.replace(GREEDY, logprobs=2))]
    plain, spec, engine = both_ways(tiny_model_dirs[family], lm, specs)
    assert texts(spec) == texts(plain)
    drafted, kept = accepted(engine)
    assert 0 < kept < drafted  # whole proposals kept and some cut: both paths ran
    assert engine.runner.rows == {} and not any(engine.runner.blocks.refs)


def test_n2_prefix_reuse_and_seeded_sampling(tiny_model_dirs: dict[str, Path], method: Method) -> None:
    """n = 2 choices each verify their own drafts; a second run of a prompt reuses its prefix blocks (named by the
    accepted tokens only); seeded sampling with speculation gives the same tokens twice."""
    family = "qwen2_5_vl"
    lm = LanguageHalf(tiny_model_dirs[family])
    image = prompts(tiny_model_dirs[family], lm)[-1]
    greedy2 = msgspec.structs.replace(GREEDY, n=2, logprobs=1)
    seeded2 = msgspec.structs.replace(GREEDY, n=2, temperature=0.8, seed=3)
    outs = []
    for cfg in ({}, {"speculative_config": method(tiny_model_dirs[family])}):
        engine = make_engine(tiny_model_dirs[family], lm, max_model_len=2048, **cfg)
        try:
            work = Work(image, greedy2, chain=chain_of(engine, image))
            first = run_one(engine, work, 2)
            again = run_one(engine, work, 2)  # its prompt's blocks, and those of the tokens fed, from the cache
            outs.append((first.per_choice(), again.per_choice()))
            assert all(e.usage is not None and e.usage.cached_tokens > 0 for e in again.events if e.type == "done")
            if cfg:
                assert accepted(engine)[0] > 0
                a, b = run_one(engine, Work(image, seeded2), 2), run_one(engine, Work(image, seeded2), 2)
                assert a.per_choice() == b.per_choice() and len(a.texts) == 2
        finally:
            engine.close()
    for spec_run, plain_run in zip(outs[1], outs[0], strict=True):
        assert_same(spec_run, plain_run)


def test_a_json_grammar_cuts_drafts_it_refuses(tiny_model_dirs: dict[str, Path], method: Method) -> None:
    """With a grammar, drafts the grammar refuses are never kept: proposals of the plain run's tokens with one
    wrong token still give the plain run's JSON (and grammar-valid output), token for token."""
    family = "llava"
    lm = LanguageHalf(tiny_model_dirs[family])
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = []
    for cfg in ({}, {"speculative_config": method(tiny_model_dirs[family])}):
        engine = make_engine(tiny_model_dirs[family], lm, max_model_len=2048, **cfg)
        try:
            req = GenerateRequest(messages=USER, sampling=sampling, **GUIDED["json"])  # type: ignore[arg-type]
            outs.append(run_one(engine, engine.prepare(req), 1).per_choice())
            if cfg:
                assert accepted(engine)[0] > 0
        finally:
            engine.close()
    assert outs[1] == outs[0]


def test_preemption_under_a_tiny_pool(tiny_model_dirs: dict[str, Path], method: Method) -> None:
    family = "qwen2_vl"
    lm = LanguageHalf(tiny_model_dirs[family])
    ps = prompts(tiny_model_dirs[family], lm)
    specs = [(p, GREEDY) for p in ps]
    outs = []
    for cfg in ({}, {"speculative_config": method(tiny_model_dirs[family])}):
        engine, _ = preempting_engine(tiny_model_dirs[family], lm, ps, **cfg)
        try:
            outs.append(texts(run(engine, specs)))
            assert engine.scheduler.num_preempted > 0
        finally:
            engine.close()
    assert outs[1] == outs[0]


def test_a_handed_off_request_decodes_with_speculation(tiny_model_dirs: dict[str, Path], method: Method) -> None:
    family = "gemma3"
    lm = LanguageHalf(tiny_model_dirs[family])
    image = prompts(tiny_model_dirs[family], lm)[-1]
    store = MemoryStore()
    engine = handoff_engine(tiny_model_dirs[family], lm, store, speculative_config=method(tiny_model_dirs[family]))
    try:
        alone = run_one(engine, Work(image, GREEDY), 1)  # records the tokens; its own drafts are the oracle's
        first, rest, resume = prefill_then_decode(engine, store, image, GREEDY, "spec")
        assert resume.kv is not None, resume.why
        assert first.texts.get(0, "") + rest.texts.get(0, "") == alone.texts[0]
        assert accepted(engine)[0] > 0
    finally:
        engine.close()


def test_the_ngram_proposer_speeds_a_repeating_answer_and_keeps_it(tiny_model_dirs: dict[str, Path]) -> None:
    """The real proposer: a tiny random model's greedy answer falls into a cycle, which the n-gram lookup then
    proposes; the answer is plain greedy's, and most proposed tokens are kept."""
    family = "llava"
    lm = LanguageHalf(tiny_model_dirs[family])
    ps = prompts(tiny_model_dirs[family], lm)
    long = msgspec.structs.replace(GREEDY, max_tokens=64)
    plain, spec, engine = both_ways(tiny_model_dirs[family], lm, [(ps[0], long), (ps[1], long)])
    assert texts(spec) == texts(plain)
    drafted, kept = accepted(engine)
    assert drafted > 0 and kept > 0
    print(f"n-gram on the tiny llava: {kept} of {drafted} proposed tokens kept")


def recorded(model_dir: Path, n: int) -> tuple[LanguageHalf, list[tuple[Any, SamplingParams]]]:
    """n greedy prompts, run once without speculation: the oracle has their tokens to propose."""
    lm = LanguageHalf(model_dir)
    specs = [(p, GREEDY) for p in prompts(model_dir, lm)[:n]]
    plain_texts(model_dir, lm, specs)
    return lm, specs


def test_no_drafts_past_disable_by_batch_size(tiny_model_dirs: dict[str, Path], oracle: Reference) -> None:
    """Three rows decoding together propose nothing at disable_by_batch_size 2; one row alone does."""
    family = "llava"
    lm, specs = recorded(tiny_model_dirs[family], 3)
    cfg = SpecConfig(num_speculative_tokens=K, disable_by_batch_size=2)
    engine = make_engine(tiny_model_dirs[family], lm, max_model_len=2048, speculative_config=cfg)
    try:
        run(engine, specs)  # prefilled in one step, then three rows decode together to the same length
        assert accepted(engine) == (0, 0)
        run(engine, specs[:1])
        assert accepted(engine)[0] > 0
    finally:
        engine.close()


def test_no_drafts_while_more_sequences_wait_than_disable_by_batch_size(
        tiny_model_dirs: dict[str, Path], oracle: Reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's count: every sequence in the engine, not only the decoding rows. At one row at a time
    (max_num_seqs 1) and disable_by_batch_size 1, the first request decodes alone while the second waits, and
    is proposed nothing; the second, alone by then, is."""
    family = "llava"
    lm, specs = recorded(tiny_model_dirs[family], 2)
    cfg = SpecConfig(num_speculative_tokens=K, disable_by_batch_size=1)
    proposed_for: list[tuple[int, ...]] = []
    propose = Speculator.propose

    def recording(self: Speculator, seq: Sequence, k: int) -> list[int]:
        proposed_for.append(oracle.key(seq)[0])
        return propose(self, seq, k)

    monkeypatch.setattr(Speculator, "propose", recording)
    first, second = (tuple(p.input_ids[0].tolist()) for p, _ in specs)
    with spec_engine(tiny_model_dirs[family], lm, cfg, max_num_seqs=1) as engine:
        run(engine, specs[:1])  # alone, the first is proposed drafts
        assert first in proposed_for
        proposed_for.clear()
        run(engine, specs)  # submitted together: the first decodes while the second waits
        assert first not in proposed_for and second in proposed_for


def test_tensor_parallel_verification_is_plain_greedy(tiny_model_dirs: dict[str, Path], oracle: Reference) -> None:
    """At --tensor-parallel-size 2 a verification's k + 1 positions go to the other rank in the step's plan like a
    prompt chunk's: the tokens are size 1's without speculation."""
    family = "qwen2_5_vl"
    lm = LanguageHalf(tiny_model_dirs[family])
    ps = prompts(tiny_model_dirs[family], lm)
    specs = [(ps[0], GREEDY), (ps[-1], GREEDY)]
    expected = plain_texts(tiny_model_dirs[family], lm, specs)
    with tp_half(tiny_model_dirs[family]) as lm2, spec_engine(tiny_model_dirs[family], lm2, SPEC) as engine:
        assert texts(run(engine, specs)) == expected
        assert accepted(engine)[1] > 0
