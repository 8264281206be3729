"""Sampling: greedy is argmax, a seed reproduces, top-k / top-p restrict the choice, penalties count the output."""
from __future__ import annotations

import math

import pytest
import torch

from decoder_service.engine.sampling import Sampler
from epd_contracts.sampling import SamplingParams
from epd_contracts.validation import convert

LOGITS = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])


def draws(params: SamplingParams, n: int = 200) -> list[int]:
    sampler = Sampler(params)
    return [sampler(LOGITS) for _ in range(n)]


def test_temperature_zero_is_argmax() -> None:
    assert set(draws(SamplingParams(temperature=0))) == {1}


def test_same_seed_gives_same_tokens_and_other_seed_differs() -> None:
    a, b = draws(SamplingParams(seed=7)), draws(SamplingParams(seed=7))
    assert a == b and a != draws(SamplingParams(seed=8))


def test_top_k_limits_choices() -> None:
    assert set(draws(SamplingParams(top_k=2, seed=1))) == {1, 2}


def test_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    assert set(draws(SamplingParams(top_p=0.1, seed=1))) == {1}


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": -0.1}, {"top_k": -2}])
def test_invalid_params_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        convert(bad, SamplingParams)


@pytest.mark.parametrize("params", [{"temperature": 1e-38}, {"temperature": 0}, {"top_p": 0.0}, {"top_p": 1e-300},
                                    {"top_k": 1}])
def test_numerically_zero_temperature_or_top_p_is_greedy(params: dict[str, float]) -> None:
    assert SamplingParams(**params).greedy  # type: ignore[arg-type]
    assert set(draws(SamplingParams(**params, seed=3), 50)) == {1}  # type: ignore[arg-type]


def test_presence_penalty_applies_once_per_generated_token() -> None:
    # 1 (3.0) is chosen, then 2.5 < 2.9 so 2, then 2.5 > 2.4 so 1, and 1 is not penalized again
    assert draws(SamplingParams(temperature=0, presence_penalty=0.5), 4) == [1, 2, 1, 1]


def test_frequency_penalty_grows_with_each_repeat() -> None:
    assert draws(SamplingParams(temperature=0, frequency_penalty=0.2), 4) == [1, 2, 1, 2]


def test_negative_penalty_favours_repeats_and_zero_changes_nothing() -> None:
    logits = torch.tensor([2.9, 3.0])
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=-1.0))
    assert [sampler(logits) for _ in range(3)] == [1, 1, 1]
    assert draws(SamplingParams(temperature=0), 3) == [1, 1, 1]


def test_penalties_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="penalty"):
        convert({"frequency_penalty": 2.5}, SamplingParams)


# --- logit_bias, min_p -----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_plus_100_forces_a_token(temperature: float) -> None:
    assert set(draws(SamplingParams(temperature=temperature, seed=0, logit_bias={3: 100}))) == {3}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_minus_100_bans_tokens(temperature: float) -> None:
    chosen = set(draws(SamplingParams(temperature=temperature, seed=0, logit_bias={1: -100, 2: -100}), 500))
    assert chosen.isdisjoint({1, 2}) and chosen


def test_logit_bias_past_the_vocabulary_is_ignored_and_the_logits_stay_as_they_were() -> None:
    logits = LOGITS.clone()
    assert draws(SamplingParams(temperature=0, logit_bias={99: 100, 2: 0.2}), 3) == [2, 2, 2]
    sampler = Sampler(SamplingParams(temperature=0, logit_bias={0: 100}))
    assert sampler(logits) == 0 and torch.equal(logits, LOGITS)


@pytest.mark.parametrize("min_p,temperature,kept", [
    (0.1, 1.0, {1, 2, 4}),  # relative to the best: 0.05, 1, 0.90, 0.02, 0.14
    (0.5, 1.0, {1, 2}),
    (1.0, 1.0, {1}),
    (0.05, 0.5, {1, 2}),  # after temperature: 0.5 sharpens token 4 to 0.02 of the best
    (0.05, 2.0, {0, 1, 2, 3, 4}),  # and 2.0 flattens every token above 0.05
])
def test_min_p_drops_tokens_below_a_fraction_of_the_best_after_temperature(min_p: float, temperature: float,
                                                                           kept: set[int]) -> None:
    params = SamplingParams(min_p=min_p, temperature=temperature, seed=5)
    assert set(draws(params, 2000)) == kept
    unfiltered = set(draws(SamplingParams(temperature=temperature, seed=5), 2000))
    assert kept < unfiltered or kept == {0, 1, 2, 3, 4}  # min_p dropped tokens that are drawn without it


def test_min_p_leaves_greedy_alone() -> None:
    assert set(draws(SamplingParams(temperature=0, min_p=1.0), 5)) == {1}


# --- choices (n > 1) -------------------------------------------------------------------------------------


def choice_draws(params: SamplingParams, index: int) -> list[int]:
    sampler = Sampler(params, index=index)
    return [sampler(LOGITS) for _ in range(100)]


def test_each_choice_of_a_seeded_request_is_reproducible_and_its_own_stream() -> None:
    params = SamplingParams(seed=11)
    first, second = choice_draws(params, 0), choice_draws(params, 1)
    assert first == choice_draws(params, 0) == draws(params, 100)
    assert second == choice_draws(params, 1) and second != first
    assert second == choice_draws(SamplingParams(seed=12), 0)  # choice i seeds with seed + i


# --- a grammar guide -------------------------------------------------------------------------------------


class AllowOnly:
    """A guide that allows a fixed set of tokens, and refuses any other."""

    def __init__(self, allowed: set[int]):
        self.allowed, self.accepted = allowed, list[int]()

    def refused(self, vocab: int, device: torch.device) -> torch.Tensor:
        keep = torch.zeros(vocab, dtype=torch.bool, device=device)
        keep[list(self.allowed)] = True
        return ~keep

    def accept(self, token: int) -> None:
        if token not in self.allowed:
            raise ValueError(f"token {token} is not allowed")
        self.accepted.append(token)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guide_restricts_the_choice_and_is_advanced_by_accept(temperature: float) -> None:
    guide = AllowOnly({0, 3})
    sampler = Sampler(SamplingParams(temperature=temperature, seed=4), guide=guide)
    chosen = [sampler(LOGITS) for _ in range(200)]
    assert set(chosen) <= {0, 3} and guide.accepted == chosen
    assert chosen[0] == 0 or temperature


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guide_wins_over_a_forcing_bias(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=4, logit_bias={1: 100, 3: -100})
    sampler = Sampler(params, guide=AllowOnly({0, 3}))
    assert {sampler(LOGITS) for _ in range(200)} == {0}  # 3 is allowed but banned; 1 is forced but not allowed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("row", [[math.nan, 5.0, math.nan, -math.inf, 1.0], [-math.inf, math.inf, -math.inf, 0.0]])
def test_a_row_with_no_usable_allowed_logit_still_yields_an_allowed_token(temperature: float,
                                                                         row: list[float]) -> None:
    sampler = Sampler(SamplingParams(temperature=temperature, seed=0), guide=AllowOnly({0, 2}))
    assert {sampler(torch.tensor(row)) for _ in range(50)} <= {0, 2}


def test_logit_bias_and_min_p_on_non_finite_rows_never_raise() -> None:
    rows = [[math.nan] * 5, [math.inf] * 5, [-math.inf] * 5, [math.inf, math.nan, -math.inf, 0.0, 3e38]]
    for row in rows:
        for params in (SamplingParams(logit_bias={0: -100, 4: 100}, min_p=1.0, seed=1),
                       SamplingParams(temperature=0, logit_bias={2: 100}, min_p=0.5)):
            sampler = Sampler(params)
            assert all(0 <= sampler(torch.tensor(row)) < 5 for _ in range(3))
