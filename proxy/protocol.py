"""The OpenAI chat-completions request, as far as the proxy reads it (pydantic at the edge only).

Sampling fields are checked once, by the contract (epd_contracts.sampling): `sampling()` converts them to it, so the
proxy refuses exactly what the decoder's engine cannot run, and refuses OpenAI features not implemented. Their
ranges in the OpenAPI document come from the contract's JSON schema. The content parts are proxy/content_parts.py's,
tools and output formats proxy/chat_features.py's.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from epd_common.errors import bad_request
from epd_contracts.generate import MAX_CACHE_SALT_CHARS, MAX_TOOLS
from epd_contracts.limits import MAX_MESSAGES, MAX_MODEL_NAME_CHARS, MAX_NAME_CHARS, MAX_PARTS_PER_MESSAGE, parts_error
from epd_contracts.sampling import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from proxy.chat_features import AnyFormat, AnyToolChoice, Features, Tool, ToolCall, features_of
from proxy.content_parts import ContentPart, MediaPart, MMProcessorKwargs, TextPart
from proxy.sampling_fields import contract_sampling, not_sampling, refuse, sampling_schema
from proxy.surrogates import SurrogateFree
from proxy.unsupported import unsupported_message_field, unsupported_parameter


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked by ChatCompletionRequest.sampling(): audio, ...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS_PER_MESSAGE)] | None = None
    name: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant turns
    tool_call_id: str | None = Field(default=None, max_length=MAX_NAME_CHARS)  # tool turns: the call answered


# vLLM's cache_salt: prefix-cached K/V is shared only between requests with the same salt (none: everyone's)
CacheSalt = Annotated[str | None, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS,
                                        description="requests share cached prompt K/V only with the same salt")]


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(SurrogateFree):
    # other fields are kept (model_extra) only to be checked: `sampling()` refuses the ones that change output
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, json_schema_extra=sampling_schema)

    model: str = Field(max_length=MAX_MODEL_NAME_CHARS)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: AnyFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnyToolChoice | None = None
    parallel_tool_calls: bool | None = None
    cache_salt: CacheSalt = None
    mm_processor_kwargs: MMProcessorKwargs | None = None  # vLLM's extension: the videos' sampling
    # the sampling fields (proxy/sampling_fields.py) are read from the extra fields by sampling(), checked by the contract alone

    @field_validator("messages")
    @classmethod
    def _total_parts(cls, messages: list[Message]) -> list[Message]:
        error = parts_error([len(m.content) if isinstance(m.content, list) else 0 for m in messages])
        if error:
            raise ValueError(error)
        return messages

    def media_parts(self) -> Iterator[MediaPart]:
        """Every image, video and audio part, in prompt order (proxy/prepare.py sorts them by kind)."""
        for m in self.messages:
            for p in m.content if isinstance(m.content, list) else ():
                if not isinstance(p, TextPart):
                    yield p

    def sampling(self) -> SamplingParams:
        """The decoder's sampling contract; raises APIError 400 `invalid_request` naming a field outside it, or
        `unsupported_parameter` naming a field this server does not implement (never a silent 200 ignoring it)."""
        if self.top_logprobs is not None and self.logprobs is not True:
            raise bad_request("top_logprobs: logprobs must be set to true when top_logprobs is used", "top_logprobs",
                              code="invalid_request")
        params = contract_sampling(self.model_extra or {}, self.n, (self.top_logprobs or 0) if self.logprobs else None)
        refuse(self._first_unsupported())
        return params

    def features(self) -> Features:
        """response_format, tools and tool_choice as the contract; a 400 naming the field they break."""
        return features_of(self.response_format, self.tools, self.tool_choice, self.parallel_tool_calls)

    def _first_unsupported(self) -> tuple[str, str] | None:
        """(param, why) of the first field this server cannot honour, top level first, then per message."""
        refused = unsupported_parameter(not_sampling(self.model_extra or {}))
        if refused is not None:
            return refused
        for i, msg in enumerate(self.messages):
            bad = unsupported_message_field(msg.model_extra or {})
            if bad is not None:
                return f"messages.{i}.{bad[0]}", bad[1]
            for j, part in enumerate(msg.content if isinstance(msg.content, list) else ()):
                if not isinstance(part, TextPart) and (bad := part.unsupported()):
                    return f"messages.{i}.content.{j}.{bad[0]}", bad[1]
        return None


class InstanceRequest(BaseModel):
    """POST/DELETE /instances: a worker to add or remove."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["encoder", "decoder", "prefill"]
    url: Annotated[str, Field(pattern=r"^https?://[^\s/]+$", max_length=512,
                              description="the worker's base URL, e.g. http://10.0.0.7:8001")]
