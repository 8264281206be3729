"""The OpenAI chat-completions request, as far as the proxy reads it (pydantic at the edge only).

Sampling fields use the contract's types (epd_contracts.sampling), so the proxy refuses exactly what the decoder's
engine cannot run; `sampling()` turns the request into that contract, refusing OpenAI features not implemented.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from epd_common.errors import APIError
from epd_contracts.limits import MAX_MESSAGES, MAX_MODEL_NAME_CHARS, MAX_NAME_CHARS, MAX_PARTS_PER_MESSAGE, parts_error
from epd_contracts.sampling import MaxTokens, Penalty, SamplingParams, Seed, StopList, Temperature, TopK, TopP
from proxy.unsupported import unsupported_message_field, unsupported_parameter


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
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(max_length=MAX_MODEL_NAME_CHARS)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # extension, as in vLLM
    seed: Seed | None = None
    stop: StopList | None = None  # a single string is accepted too (one stop)
    n: int | None = Field(default=None, ge=1, le=128)  # only 1 is implemented: sampling() refuses more
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    ignore_eos: bool = False  # extension, as in vLLM

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, stop: object) -> object:
        return [stop] if isinstance(stop, str) else stop

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
        """The decoder's sampling contract; raises APIError 400 `unsupported_parameter` naming a field this
        server does not implement (never a silent 200 that ignores it)."""
        refused = self._first_unsupported()
        if refused is not None:
            raise APIError(400, f"{refused[0]}: {refused[1]}", param=refused[0], code="unsupported_parameter")
        given: dict[str, Any] = {
            "max_tokens": self.max_completion_tokens or self.max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "stop": self.stop,
            "ignore_eos": self.ignore_eos, "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty}
        # unset fields take the contract's defaults
        return SamplingParams.model_validate({k: v for k, v in given.items() if v is not None})

    def _first_unsupported(self) -> tuple[str, str] | None:
        """(param, why) of the first field this server cannot honour, top level first, then per message."""
        refused = unsupported_parameter({**(self.model_extra or {}), "n": self.n})
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
