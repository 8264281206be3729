"""The OpenAI chat-completions request, as far as the proxy reads it (pydantic at the edge only).

Sampling fields are checked once, by the contract (epd_contracts.sampling): `sampling()` converts them to it, so the
proxy refuses exactly what the decoder's engine cannot run, and refuses OpenAI features not implemented. Their
ranges in the OpenAPI document come from the contract's JSON schema.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from epd_common.errors import APIError, bad_request
from epd_contracts.limits import MAX_MESSAGES, MAX_MODEL_NAME_CHARS, MAX_NAME_CHARS, MAX_PARTS_PER_MESSAGE, parts_error
from epd_contracts.sampling import SamplingParams
from epd_contracts.validation import ContractError, convert
from proxy.unsupported import unsupported_message_field, unsupported_parameter

_CONTRACT = msgspec.json.schema(SamplingParams)["$defs"]["SamplingParams"]["properties"]
# request field -> the contract's field it sets: the contract's own names, and OpenAI's newer name of max_tokens
_SAMPLING = {**{name: name for name in _CONTRACT}, "max_completion_tokens": "max_tokens"}


def _sampling_schema(schema: dict[str, Any]) -> None:
    """The OpenAPI document shows each sampling field with the contract's ranges (optional, null allowed)."""
    for name, field in _SAMPLING.items():
        prop = {k: v for k, v in _CONTRACT[field].items() if k != "default"}
        schema["properties"][name] = prop if "anyOf" in prop else {"anyOf": [prop, {"type": "null"}]}


def _contract_params(fields: dict[str, Any], max_tokens_from: str | None = None) -> SamplingParams:
    """`fields` as the contract, or a 400 `invalid_request` naming the field (as the client spelled it)."""
    try:
        return convert(fields, SamplingParams, strict=False)  # as lax as pydantic was: 3.0 and "3" are 3
    except ContractError as exc:
        param = max_tokens_from if max_tokens_from and exc.param == "max_tokens" else exc.param
        raise bad_request(f"{param}: {exc.detail}" if param else exc.detail, param, code="invalid_request") from None


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


# any other part type (input_audio, file, video_url, refusal, ...) is a 400 naming the part
ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked by ChatCompletionRequest.sampling(): tool_calls, audio, ...

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS_PER_MESSAGE)] | None = None
    name: str | None = Field(default=None, max_length=MAX_NAME_CHARS)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    # other fields are kept (model_extra) only to be checked: `sampling()` refuses the ones that change output
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, json_schema_extra=_sampling_schema)

    model: str = Field(max_length=MAX_MODEL_NAME_CHARS)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=128)  # only 1 is implemented: sampling() refuses more
    # the sampling fields (_SAMPLING) are read from the extra fields by sampling(), checked by the contract alone

    @field_validator("messages")
    @classmethod
    def _total_parts(cls, messages: list[Message]) -> list[Message]:
        error = parts_error([len(m.content) if isinstance(m.content, list) else 0 for m in messages])
        if error:
            raise ValueError(error)
        return messages

    def num_images(self) -> int:
        return sum(isinstance(p, ImagePart) for m in self.messages if isinstance(m.content, list) for p in m.content)

    def sampling(self) -> SamplingParams:
        """The decoder's sampling contract; raises APIError 400 `invalid_request` naming a field outside it, or
        `unsupported_parameter` naming a field this server does not implement (never a silent 200 ignoring it)."""
        params = self._to_contract()
        refused = self._first_unsupported()
        if refused is not None:
            raise APIError(400, f"{refused[0]}: {refused[1]}", param=refused[0], code="unsupported_parameter")
        return params

    def _to_contract(self) -> SamplingParams:
        """The given sampling fields as the contract (unset ones take its defaults), each error under its own name."""
        extra = self.model_extra or {}
        given = {name: v for name in _SAMPLING if (v := extra.get(name)) is not None}
        if isinstance(given.get("stop"), str):
            given["stop"] = [given["stop"]]  # a single string is one stop
        if "max_completion_tokens" in given and "max_tokens" in given:  # the newer name wins; both are checked
            _contract_params({"max_tokens": given.pop("max_tokens")})
        return _contract_params({_SAMPLING[name]: v for name, v in given.items()},
                                "max_completion_tokens" if "max_completion_tokens" in given else None)

    def _first_unsupported(self) -> tuple[str, str] | None:
        """(param, why) of the first field this server cannot honour, top level first, then per message."""
        others = {k: v for k, v in (self.model_extra or {}).items() if k not in _SAMPLING}
        refused = unsupported_parameter({**others, "n": self.n})
        if refused is not None:
            return refused
        for i, msg in enumerate(self.messages):
            bad = unsupported_message_field(msg.model_extra or {})
            if bad is not None:
                return f"messages.{i}.{bad[0]}", bad[1]
        return None


class InstanceRequest(BaseModel):
    """POST/DELETE /instances: a worker to add or remove."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["encoder", "decoder"]
    url: Annotated[str, Field(pattern=r"^https?://[^\s/]+$", max_length=512,
                              description="the worker's base URL, e.g. http://10.0.0.7:8001")]
