"""Speculative decoding's parts alone: `--speculative-config` checking, the n-gram lookup, and the rejection rule that
keeps a sampled token distributed as the target's (a chi-square test with a stated power)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from decoder_service.cli import parse_args
from decoder_service.engine.sampling import Sampler
from decoder_service.engine.spec.config import SpecConfig, parse_spec_config
from decoder_service.engine.spec.ngram import MASKED, propose, text_history
from decoder_service.engine.spec.propose import media_token_ids
from epd_contracts.sampling import SamplingParams


def test_vllms_json_is_parsed_and_defaults_filled() -> None:
    cfg = parse_spec_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert cfg == SpecConfig("ngram", 3, 5, 1, cfg.disable_by_batch_size)  # vLLM: max alone -> min 1
    assert parse_spec_config('{"method": "ngram", "num_speculative_tokens": 2}').prompt_lookup_min == 2
    assert parse_spec_config('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}'
                             ).disable_by_batch_size == 4
    draft = parse_spec_config('{"model": "/models/draft", "num_speculative_tokens": 5}')  # vLLM: model -> a draft
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/draft", 5)


@pytest.mark.parametrize(("text", "says"), [
    ("not json", "not JSON"),
    ("[1]", "JSON object"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "from 1 to 16"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "from 1 to 16"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "> prompt"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key(s) typo"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', 'need "model"'),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', 'need "model"'),
    ('{"method": "ngram", "model": "/models/draft", "num_speculative_tokens": 2}', "ngram takes none"),
    ('{"method": "medusa", "model": "/m", "num_speculative_tokens": 2}', "not supported by this decoder yet"),
    ('{"method": "magic", "num_speculative_tokens": 2}', 'method must be "ngram", "draft_model" or "eagle3"'),
])
def test_a_bad_config_is_refused_naming_what_is_wrong(text: str, says: str, capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    with pytest.raises(ValueError, match=None) as err:
        parse_spec_config(text)
    assert says in str(err.value)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--insecure", "--speculative-config", text])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_the_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    h = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3, 4])
    assert propose(h, 3, 4, 2) == [5, 9, 2]  # the longest match first: [1, 2, 3, 4], at the start
    assert propose(h, 3, 3, 2) == [7, 8, 1]  # n <= 3: [2, 3, 4], at its latest earlier occurrence
    assert propose(h, 0, 4, 2) == []
    assert propose(np.array([1, 2, 3]), 2, 4, 2) == []  # nothing repeats
    assert propose(np.array([5, 6, 5, 6]), 4, 2, 2) == [5, 6]  # up to the end of the history
    loop = np.array([9, 5, 6, 5, 6, 5, 6, 5, 6])
    assert propose(loop, 4, 2, 2) == [5, 6, 5, 6]  # a loop of period 2: an earlier occurrence proposes all k


def test_media_placeholders_never_match_nor_are_proposed() -> None:
    image = 50
    h = text_history([1, 2, image, image, image, 3, 1, 2], {image})
    assert (h == MASKED).sum() == 3
    assert propose(h, 4, 2, 2) == []  # [1, 2] was followed by the image: nothing proposed
    h2 = np.concatenate([text_history([image, image], {image}), np.array([image, image])])
    assert propose(text_history(h2.tolist(), {image}), 2, 2, 1) == []


def test_media_ids_come_from_the_config_and_its_text_config() -> None:
    class Text:
        audio_token_id = 7

    class Config:
        image_token_id, video_token_id = 5, -1

        def get_text_config(self) -> Text:
            return Text()

    assert media_token_ids(Config()) == {5, 7}


# Rejection sampling with a deterministic proposal. N draws of one position; the statistic is Pearson's chi-square
# against the target p over the 6 tokens (5 degrees of freedom), refused above CRITICAL (alpha = 1e-4).
# Power: a rule whose output distribution q has chi-square distance sum((q - p)^2 / p) >= 0.002 (e.g. one token's
# probability off by 1.5 points here) gives a noncentral chi-square with lambda = N * 0.002 = 80: mean 85, sd 18,
# so it is refused with probability > 0.999. The last test shows the rule with one step wrong is refused.
N = 40_000
CRITICAL = 25.74  # chi-square, 5 degrees of freedom, upper 1e-4 quantile
LOGITS = torch.tensor([2.0, 1.2, 0.5, 0.0, -0.7, -3.0])


def draws(draft: int, params: SamplingParams, rule: str = "verify") -> np.ndarray:
    sampler = Sampler(params)
    counts = np.zeros(len(LOGITS))
    for _ in range(N):
        if rule == "verify":
            token = int(sampler._verify(LOGITS, draft))
        else:  # wrong on purpose: a rejected draft is drawn again from p, draft included
            probs = sampler._probs(LOGITS)
            keep = float(torch.rand((), generator=sampler.generator)) < float(probs[draft])
            token = draft if keep else int(torch.multinomial(probs, 1, generator=sampler.generator))
        counts[token] += 1
    return counts


def chi_square(counts: np.ndarray, params: SamplingParams) -> float:
    p = Sampler(params)._probs(LOGITS).double().numpy()
    live = p > 0
    assert counts[~live].sum() == 0  # nothing outside the support (top-k cut it)
    expected = N * p[live]
    return float(((counts[live] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", [0, 2, 5])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, seed=2),
                                    SamplingParams(temperature=1.3, top_k=4, seed=3)], ids=["t1", "t0.7", "top4"])
def test_verified_tokens_are_distributed_as_the_target(draft: int, params: SamplingParams) -> None:
    stat = chi_square(draws(draft, params), params)
    dof = int((Sampler(params)._probs(LOGITS) > 0).sum()) - 1
    assert stat < (CRITICAL if dof == 5 else 23.51), stat  # 23.51: 4 degrees of freedom at 1e-4


def test_the_test_refuses_a_rule_with_one_step_wrong() -> None:
    params = SamplingParams(temperature=1.0, seed=1)
    assert chi_square(draws(2, params, rule="wrong"), params) > CRITICAL * 4


def test_a_seed_makes_verification_reproducible() -> None:
    params = SamplingParams(temperature=0.9, seed=12)
    a, b = Sampler(params), Sampler(params)
    assert [int(a._verify(LOGITS, 1)) for _ in range(50)] == [int(b._verify(LOGITS, 1)) for _ in range(50)]
