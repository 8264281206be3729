"""Speculative decoding with a draft model: a tiny checkpoint of the same family and tokenizer proposes; greedy output
is plain greedy's token for token for every family (images in the prompt), whether the draft is the target itself
(nearly every draft of a text prompt kept; with an image, which the draft does not see, fewer) or another random model (nearly every draft rejected); a draft with another tokenizer is
refused at start."""
from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from decoder_service.engine.spec.config import SpecConfig
from decoder_service.preflight import check_draft_model
from epd_builders.tiny import FAMILIES, TinySpec, build_tiny
from epd_common.startup import ConfigError
from epd_models.halves import LanguageHalf
from tests.decoder_service.engine_run import run
from tests.decoder_service.test_preemption import prompts
from tests.decoder_service.test_speculative import GREEDY, K, accepted, plain_texts, spec_engine, texts


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> a one-layer random model of the family (another seed: its proposals are mostly wrong)."""
    root = tmp_path_factory.mktemp("drafts")
    built: dict[str, Path] = {}

    class Drafts(dict[str, Path]):
        def __missing__(self, family: str) -> Path:
            built[family] = build_tiny(TinySpec(family=family, text_layers=1, lm_scale=3.0, seed=1), root / family)
            return built[family]

    return Drafts()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_draft_model_is_plain_greedy(tiny_model_dirs: dict[str, Path], drafts: dict[str, Path],
                                                   family: str) -> None:
    target = tiny_model_dirs[family]
    lm = LanguageHalf(target)
    ps = prompts(target, lm)
    specs = [(ps[0], GREEDY), (ps[-1], GREEDY), (ps[-1], msgspec.structs.replace(GREEDY, logprobs=2))]
    expected = plain_texts(target, lm, specs)
    kept = {}
    for name, draft in (("itself", target), ("another", drafts[family])):
        check_draft_model(target, str(draft))
        with spec_engine(target, lm, SpecConfig("draft_model", K, disable_by_batch_size=64, model=str(draft))) as engine:
            assert texts(run(engine, specs)) == expected, name
            before = accepted(engine)
            assert texts(run(engine, specs[:1])) == expected[:1], name  # text only: the draft sees all of it
            kept[name] = tuple(b - a for a, b in zip(before, accepted(engine), strict=True))
            assert engine.runner.rows == {} and not any(engine.runner.blocks.refs)
    drafted, ok = kept["itself"]
    assert ok >= 0.9 * drafted > 0  # the target as its own draft, a text prompt: it proposes its own greedy tokens
    print(f"{family}: draft = target kept {ok} of {drafted}; another random model kept {kept['another']}")


def test_a_draft_with_another_tokenizer_is_refused(tiny_model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="does not have the target's tokenizer"):
        check_draft_model(tiny_model_dirs["llava"], str(tiny_model_dirs["gemma3"]))
    with pytest.raises(ConfigError, match="--speculative-config"):
        check_draft_model(tiny_model_dirs["llava"], "/nonexistent/draft")


def test_the_draft_prefills_a_long_prompt_over_several_steps(tiny_model_dirs: dict[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """At most PREFILL_TOKENS draft positions a step (a long prompt never stalls the target's step): with 8, the
    draft's prompt takes several steps, its rows then catch up, and the output is still plain greedy's."""
    from decoder_service.engine.spec import draft as draft_module

    monkeypatch.setattr(draft_module, "PREFILL_TOKENS", 8)
    target = tiny_model_dirs["llava"]
    lm = LanguageHalf(target)
    ps = prompts(target, lm)
    specs = [(ps[3], GREEDY), (ps[0], GREEDY)]
    expected = plain_texts(target, lm, specs)
    with spec_engine(target, lm, SpecConfig("draft_model", K, disable_by_batch_size=64, model=str(target))) as engine:
        assert texts(run(engine, specs)) == expected
        drafted, kept = accepted(engine)
        assert kept >= 0.9 * drafted > 0
