"""The sampling contract admits exactly what the engine's Sampler can run, and the Sampler runs all of it."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoder_service.engine.logprobs import TokenTable
from decoder_service.engine.sampling import Sampler
from epd_contracts.sampling import (
    GREEDY_BELOW,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MIN_SEED,
    SamplingParams,
)
from epd_contracts.validation import ContractError, convert, decode_json

ROOT = Path(__file__).resolve().parents[2]
PROPERTY = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def refused(**fields: Any) -> ContractError:
    with pytest.raises(ContractError) as err:
        convert(fields, SamplingParams)
    return err.value


# --- integer ranges -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [MIN_SEED, -1, 0, 2**63, MAX_SEED])
def test_every_admitted_seed_seeds_the_real_sampler(seed: int) -> None:
    logits = torch.arange(8, dtype=torch.float32)
    a, b = Sampler(SamplingParams(seed=seed)), Sampler(SamplingParams(seed=seed))
    assert [a(logits) for _ in range(8)] == [b(logits) for _ in range(8)]


@pytest.mark.parametrize("seed", [MIN_SEED - 1, MAX_SEED + 1])
def test_seed_range_is_exactly_what_torch_accepts(seed: int) -> None:
    with pytest.raises(ValueError, match="Overflow"):  # one past either end kills manual_seed ...
        torch.Generator().manual_seed(seed)
    assert refused(seed=seed).param == "seed"  # ... so the contract refuses it first


@pytest.mark.parametrize("field,value", [("top_k", MAX_TOP_K + 1), ("top_k", -2), ("max_tokens", MAX_TOKENS + 1),
                                         ("max_tokens", 0), ("seed", 1.5), ("top_k", "ten"), ("n", 0),
                                         ("n", MAX_N + 1), ("n", 1.5), ("logprobs", -1),
                                         ("logprobs", MAX_TOP_LOGPROBS + 1), ("logprobs", True)])
def test_integer_out_of_range_or_not_an_integer_is_refused(field: str, value: object) -> None:
    assert refused(**{field: value}).param == field


def test_top_k_minus_one_is_off_as_in_vllm() -> None:
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams().top_k


def test_max_tokens_is_optional_and_resolved_by_the_decoder() -> None:
    params = SamplingParams(temperature=0.5)
    assert params.max_tokens is None
    assert params.with_max_tokens(7) == SamplingParams(temperature=0.5, max_tokens=7)


# --- floats ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["temperature", "top_p", "frequency_penalty", "presence_penalty", "min_p"])
@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_floats_from_json_are_refused(field: str, text: str) -> None:
    raw = f'{{"{field}": {text}}}'
    fields = json.loads(raw)  # Python's json module accepts these
    assert refused(**fields).param == field
    with pytest.raises(ContractError) as err:
        decode_json(raw.encode(), SamplingParams)
    assert err.value.param == field


@pytest.mark.parametrize("field,value", [("temperature", 2.01), ("temperature", -1e-9), ("top_p", 1.0001),
                                         ("top_p", -0.1), ("frequency_penalty", 2.5), ("presence_penalty", -2.5),
                                         ("min_p", -0.01), ("min_p", 1.01)])
def test_floats_outside_their_floor_and_ceiling_are_refused(field: str, value: float) -> None:
    assert refused(**{field: value}).param == field


@pytest.mark.parametrize("fields", [{"temperature": 1e-38}, {"temperature": 5e-324}, {"top_p": 0.0},
                                    {"top_p": 1e-46}, {"temperature": 0.7, "top_p": GREEDY_BELOW / 2}])
def test_numerically_zero_temperature_or_top_p_is_greedy(fields: dict[str, float]) -> None:
    params = SamplingParams(**fields, seed=1)  # type: ignore[arg-type]
    logits = torch.tensor([0.0, 1.0, 1.0 - 1e-6, -3.0])
    sampler = Sampler(params)
    assert params.greedy and [sampler(logits) for _ in range(20)] == [1] * 20


def test_temperature_just_above_the_greedy_threshold_samples_without_overflow() -> None:
    sampler = Sampler(SamplingParams(temperature=GREEDY_BELOW, seed=0))
    assert sampler(torch.tensor([3e38, -3e38, 3e38, 0.0])) in (0, 2)


# --- strings and lists ----------------------------------------------------------------------------------


def test_stop_strings_are_capped_in_count_and_length_and_never_empty() -> None:
    ok = convert({"stop": ["a" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}, SamplingParams)
    assert ok.stop == ("a" * MAX_STOP_CHARS,) * MAX_STOP_STRINGS
    assert refused(stop=["x"] * (MAX_STOP_STRINGS + 1)).param == "stop"
    assert refused(stop=["x", ""]).param == "stop.1"
    assert refused(stop=["a" * (MAX_STOP_CHARS + 1)]).param == "stop.0"


def test_stop_token_ids_are_token_ids_and_capped_in_count() -> None:
    assert convert({"stop_token_ids": [0, 2**31 - 1]}, SamplingParams).stop_token_ids == (0, 2**31 - 1)
    assert refused(stop_token_ids=[0] * (MAX_STOP_TOKEN_IDS + 1)).param == "stop_token_ids"
    assert refused(stop_token_ids=[1, -1]).param == "stop_token_ids.1"
    assert refused(stop_token_ids=[2**31]).param == "stop_token_ids.0"


def test_logit_bias_takes_token_ids_as_json_keys_with_biases_in_openais_range() -> None:
    params = decode_json(b'{"logit_bias": {"7": -100, "0": 100, "3": 0.5}}', SamplingParams)
    assert params.logit_bias == {7: -100.0, 0: 100.0, 3: 0.5}
    assert convert({"logit_bias": {"7": 1}}, SamplingParams, strict=False).logit_bias == {7: 1.0}  # as the proxy


@pytest.mark.parametrize("body", [b'{"logit_bias": {"1": 100.5}}', b'{"logit_bias": {"1": -101}}',
                                  b'{"logit_bias": {"1": NaN}}', b'{"logit_bias": {"-1": 1}}',
                                  b'{"logit_bias": {"x": 1}}', b'{"logit_bias": {"2147483648": 1}}',
                                  b'{"logit_bias": [1]}'])
def test_logit_bias_out_of_range_or_not_token_ids_is_refused_naming_logit_bias(body: bytes) -> None:
    with pytest.raises(ContractError) as err:
        decode_json(body, SamplingParams)
    assert err.value.param == "logit_bias"


def test_logit_bias_is_capped_in_entries() -> None:
    assert len(convert({"logit_bias": {i: 1 for i in range(MAX_LOGIT_BIAS)}}, SamplingParams).logit_bias) == 1024
    assert refused(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)}).param == "logit_bias"


# --- the model itself -----------------------------------------------------------------------------------


def test_contract_is_frozen_and_refuses_unknown_fields() -> None:
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]
    assert refused(typical_p=0.9).param == "typical_p" and "unknown field" in refused(typical_p=0.9).message


def test_contract_round_trips_through_json() -> None:
    params = SamplingParams(max_tokens=9, temperature=0.3, top_p=0.9, top_k=5, seed=MAX_SEED, stop=("\n",),
                            ignore_eos=True, frequency_penalty=-2, presence_penalty=2, n=3, logprobs=20,
                            logit_bias={5: -100, 2**31 - 1: 100}, min_p=0.05, stop_token_ids=(2, 3))
    assert decode_json(msgspec.json.encode(params), SamplingParams) == params


def test_the_contract_and_the_proxy_request_import_no_torch() -> None:
    code = "import sys, epd_contracts.sampling, proxy.protocol; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# --- property: every admitted value runs ----------------------------------------------------------------


def _floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    edges = st.sampled_from([lo, hi, 0.0, GREEDY_BELOW, GREEDY_BELOW * (1 - 1e-9), 5e-324, 1e-38])
    return st.one_of(edges.filter(lambda v: lo <= v <= hi), st.floats(lo, hi, allow_nan=False))


admitted_params = st.builds(
    SamplingParams,
    temperature=_floats(0.0, 2.0), top_p=_floats(0.0, 1.0), frequency_penalty=_floats(-2.0, 2.0),
    presence_penalty=_floats(-2.0, 2.0),
    top_k=st.one_of(st.sampled_from([-1, 0, 1, 2, MAX_TOP_K]), st.integers(-1, MAX_TOP_K)),
    seed=st.one_of(st.none(), st.sampled_from([MIN_SEED, MAX_SEED]), st.integers(MIN_SEED, MAX_SEED)),
    n=st.integers(1, MAX_N), min_p=_floats(0.0, 1.0),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_TOP_LOGPROBS)),
    logit_bias=st.dictionaries(st.one_of(st.integers(0, 60), st.just(2**31 - 1)), _floats(-100.0, 100.0),
                               max_size=8),
)


class _Letters:
    """The least a TokenTable needs of a tokenizer: token id i is one letter."""

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, token: int) -> str:
        return self.decode([token])


TOKENS = TokenTable(_Letters())

_HUGE = float(torch.finfo(torch.float32).max)
_values = st.one_of(st.floats(width=32), st.sampled_from([math.inf, -math.inf, math.nan, _HUGE, -_HUGE, 0.0]))
logit_rows = st.one_of(
    st.lists(_values, min_size=1, max_size=48),
    st.tuples(st.floats(width=32, allow_nan=False), st.integers(1, 48)).map(lambda t: [t[0]] * t[1]),  # all equal
    st.lists(st.sampled_from([_HUGE, -_HUGE, math.inf, -math.inf]), min_size=1, max_size=48),
)


@PROPERTY
@given(params=admitted_params, row=logit_rows, dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_any_admitted_params_and_any_logits_give_a_token(params: SamplingParams, row: list[float],
                                                         dtype: torch.dtype) -> None:
    logits = torch.tensor(row, dtype=torch.float32).to(dtype)
    sampler = Sampler(params, index=params.n - 1, tokens=TOKENS)
    tokens = [sampler(logits) for _ in range(3)]  # from the second choice on, penalties apply
    assert all(0 <= t < len(row) for t in tokens)
    entry = sampler.logprob_entry(tokens[-1])
    assert (entry is None) == (params.logprobs is None)
    if entry is not None:
        assert len(entry.top_logprobs) == min(params.logprobs or 0, len(row))
        assert all(math.isfinite(v) and v <= 0 for v in [entry.logprob, *(t.logprob for t in entry.top_logprobs)])
    first = Sampler(params, tokens=TOKENS)(logits)
    biased = logits.float() + torch.zeros(len(row)).index_add(  # what the sampler sees (NaN + bias is NaN)
        0, torch.tensor([t for t in params.logit_bias if t < len(row)], dtype=torch.long),
        torch.tensor([b for t, b in params.logit_bias.items() if t < len(row)]))
    usable = [not (math.isnan(v) or v == -math.inf) for v in biased.tolist()]
    if any(usable) and not any(math.isnan(v) for v in biased.tolist()):
        assert usable[first], f"chose an impossible token {first} from {row}"
