"""Sampling: greedy is argmax, a seed reproduces, top-k / top-p restrict the choice, penalties count the output."""
from __future__ import annotations

import pytest
import torch

from decoder_service.sampling import Sampler
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
