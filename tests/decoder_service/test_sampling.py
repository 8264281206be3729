"""Sampling: greedy is argmax, a seed reproduces, top-k / top-p restrict the choice."""
from __future__ import annotations

import pytest
import torch

from decoder_service.sampling import Sampler, SamplingParams

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


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1}])
def test_invalid_params_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)  # type: ignore[arg-type]
