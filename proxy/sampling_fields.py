"""Sampling fields of a request (chat or completions) -> the one sampling contract (epd_contracts.sampling).

Each field is checked once, by the contract: the proxy refuses exactly what the decoder's engine cannot run, each
error named by the field as the client spelled it. Fields that are not sampling fields are checked against the
unsupported table (proxy/unsupported.py): `refuse` answers 400 `unsupported_parameter`.
"""
from __future__ import annotations

import re
from typing import Any

import msgspec

from epd_common.errors import APIError, bad_request
from epd_contracts.sampling import SamplingParams
from epd_contracts.validation import ContractError, convert

_CONTRACT = msgspec.json.schema(SamplingParams)["$defs"]["SamplingParams"]["properties"]
# request field -> the contract's field it sets: the contract's own names, and OpenAI's newer name of max_tokens;
# `n` and `logprobs` are request fields of their own (OpenAI's logprobs is a bool, the contract's a count)
_SAMPLING = {**{name: name for name in _CONTRACT if name not in ("n", "logprobs")}, "max_completion_tokens": "max_tokens"}
_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")


def sampling_schema(schema: dict[str, Any]) -> None:
    """The OpenAPI document shows each sampling field with the contract's ranges (optional, null allowed)."""
    for name, target in _SAMPLING.items():
        prop = {k: v for k, v in _CONTRACT[target].items() if k != "default"}
        schema["properties"][name] = prop if "anyOf" in prop else {"anyOf": [prop, {"type": "null"}]}


def _contract_params(fields: dict[str, Any], max_tokens_from: str | None = None) -> SamplingParams:
    """`fields` as the contract, or a 400 `invalid_request` naming the field (as the client spelled it)."""
    try:
        return convert(fields, SamplingParams, strict=False)  # as lax as pydantic was: 3.0 and "3" are 3
    except ContractError as exc:
        param = max_tokens_from if max_tokens_from and exc.param == "max_tokens" else exc.param
        raise bad_request(f"{param}: {exc.detail}" if param else exc.detail, param, code="invalid_request") from None


def not_sampling(extra: dict[str, Any]) -> dict[str, Any]:
    """A request's extra fields that are not sampling fields: each is checked by `unsupported_parameter`."""
    return {k: v for k, v in extra.items() if k not in _SAMPLING}


def refuse(refused: tuple[str, str] | None) -> None:
    """A 400 `unsupported_parameter` naming the field (never a silent 200 ignoring it); None: nothing refused."""
    if refused is not None:
        raise APIError(400, f"{refused[0]}: {refused[1]}", param=refused[0], code="unsupported_parameter")


def _check_logit_bias(bias: Any) -> None:
    """OpenAI's shape: token ids as JSON object keys (strings of digits); the contract checks the values."""
    if not isinstance(bias, dict) or not all(isinstance(k, str) and _TOKEN_ID.match(k) for k in bias):
        raise bad_request("logit_bias: expected an object mapping token ids (strings of digits) to numbers "
                          "in [-100, 100]", "logit_bias", code="invalid_request")
    for key, value in bias.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias: the bias of token {key} must be a number in [-100, 100]", "logit_bias",
                              code="invalid_request")


def contract_sampling(extra: dict[str, Any], n: int | None = None, logprobs: int | None = None,
                      default_max_tokens: int | None = None) -> SamplingParams:
    """The given sampling fields as the contract (unset ones take its defaults), each error under its own name."""
    given = {name: v for name in _SAMPLING if (v := extra.get(name)) is not None}
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]  # a single string is one stop
    if "logit_bias" in given:
        _check_logit_bias(given["logit_bias"])
    if "max_completion_tokens" in given and "max_tokens" in given:  # the newer name wins; both are checked
        _contract_params({"max_tokens": given.pop("max_tokens")})
    fields = {_SAMPLING[name]: v for name, v in given.items()}
    if default_max_tokens is not None:
        fields.setdefault("max_tokens", default_max_tokens)
    fields.update({k: v for k, v in (("n", n), ("logprobs", logprobs)) if v is not None})
    return _contract_params(fields, "max_completion_tokens" if "max_completion_tokens" in given else None)
