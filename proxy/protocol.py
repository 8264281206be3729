"""The OpenAI chat-completions request, as far as the proxy reads it (pydantic at the edge only).

Sampling fields are checked once, by the contract (epd_contracts.sampling): `sampling()` converts them to it, so the
proxy refuses exactly what the decoder's engine cannot run, and refuses OpenAI features not implemented. Their
ranges in the OpenAPI document come from the contract's JSON schema.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from epd_common.errors import bad_request
from epd_contracts.generate import MAX_CACHE_SALT_CHARS, MAX_SCHEMA_BYTES, MAX_TOOLS, ResponseFormat, ToolChoice
from epd_contracts.limits import MAX_MESSAGES, MAX_MODEL_NAME_CHARS, MAX_NAME_CHARS, MAX_PARTS_PER_MESSAGE, parts_error
from epd_contracts.sampling import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from epd_contracts.schema_checks import MAX_SCHEMA_DEPTH, schema_cost_error, unsatisfiable
from proxy.sampling_fields import contract_sampling, not_sampling, refuse, sampling_schema
from proxy.surrogates import SurrogateFree
from proxy.unsupported import unsupported_message_field, unsupported_parameter


class ImageURL(BaseModel):
    # any other key (vLLM's `uuid`, an `mm_hash`) is a 400 unsupported_parameter (ImagePart.unsupported): a client
    # never names what an image is cached under; the proxy hashes its bytes
    model_config = ConfigDict(extra="allow")

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused like ImageURL's (vLLM puts `uuid` on the part)

    type: Literal["image_url"]
    image_url: ImageURL

    def unsupported(self) -> tuple[str, str] | None:
        """(key, why) of the first key of the part or of its image_url this server does not take."""
        return _first_extra(("", self.model_extra), ("image_url.", self.image_url.model_extra))


def _first_extra(*levels: tuple[str, dict[str, Any] | None]) -> tuple[str, str] | None:
    """(prefix + key, why) of the first extra key, level by level, this server does not take."""
    for prefix, extra in levels:
        refused = unsupported_parameter(extra or {}, frozenset())
        if refused is not None:
            return prefix + refused[0], refused[1]
    return None


class VideoURL(BaseModel):
    url: str


class VideoURLPart(BaseModel):
    """vLLM's video part: {"type": "video_url", "video_url": {"url": ...}} (proxy/video.py plans it)."""

    type: Literal["video_url"]
    video_url: VideoURL


class InputAudio(BaseModel):
    """OpenAI's input_audio: the file's bytes in base64 (decoded, capped and probed by proxy/audio.py)."""

    model_config = ConfigDict(extra="allow")  # any other key: 400 unsupported_parameter, as ImageURL's

    data: str
    format: Literal["wav", "mp3"]


class InputAudioPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused like ImagePart's

    type: Literal["input_audio"]
    input_audio: InputAudio

    def unsupported(self) -> tuple[str, str] | None:
        return _first_extra(("", self.model_extra), ("input_audio.", self.input_audio.model_extra))


class AudioURL(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused like ImageURL's

    url: str


class AudioURLPart(BaseModel):
    """vLLM's audio part: {"type": "audio_url", "audio_url": {"url": ...}}, loaded under the image URL rules."""

    model_config = ConfigDict(extra="allow")  # refused like ImagePart's

    type: Literal["audio_url"]
    audio_url: AudioURL

    def unsupported(self) -> tuple[str, str] | None:
        return _first_extra(("", self.model_extra), ("audio_url.", self.audio_url.model_extra))


# any other part type (file, refusal, ...) is a 400 naming the part
ContentPart = Annotated[TextPart | ImagePart | VideoURLPart | InputAudioPart | AudioURLPart,
                        Field(discriminator="type")]


class MMProcessorKwargs(BaseModel):
    """vLLM's `mm_processor_kwargs`, as far as it is honoured here: a request's video sampling, within the server's
    limits (checked by proxy/video.py against --max-video-frames and the model's pixel bounds), and whether each
    video's sound track goes in with its frames (Qwen2.5-Omni). Any other key is a 400 naming it; fps and num_frames
    together are a 400 (transformers refuses them too)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    fps: float | None = Field(default=None, gt=0, description="frames per second to sample from each video")
    num_frames: int | None = Field(default=None, ge=1, description="frames to sample from each video")
    max_pixels: int | None = Field(default=None, ge=1, description="pixel budget of each sampled frame")
    use_audio_in_video: bool = Field(default=False, strict=True,
                                     description="each video's sound track interleaved with its frames")


_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's pattern for function and json_schema names


class ToolCallFunction(BaseModel):
    name: str = Field(max_length=MAX_NAME_CHARS)
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """An assistant turn's call, echoed back in the history (OpenAI's ChatCompletionMessageToolCall)."""

    id: str = Field(max_length=MAX_NAME_CHARS)
    type: Literal["function"]
    function: ToolCallFunction


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


class FunctionDef(BaseModel):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object; none: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]  # OpenAI's "custom" tools (free-form text input) are not implemented
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class FormatText(BaseModel):
    type: Literal["text"]


class FormatJsonObject(BaseModel):
    type: Literal["json_object"]


class FormatJsonSchema(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


AnyFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


def _schema_fits(schema: dict[str, Any] | None, param: str) -> None:
    """Compiling a grammar is bounded by the schema's size and by the counts that drive its cost, and a schema no
    finite output matches is refused (epd_contracts/schema_checks.py): all before it reaches a decoder."""
    if schema is None:
        return
    try:  # the size first: measured at C speed, it bounds the walks below
        size = len(json.dumps(schema, separators=(",", ":")))
    except RecursionError:
        raise bad_request(f"{param}: the schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels", param,
                          code="schema_too_complex") from None
    if size > MAX_SCHEMA_BYTES:
        raise bad_request(f"{param}: the schema is larger than {MAX_SCHEMA_BYTES} bytes as JSON", param,
                          code="invalid_request")
    if (why := schema_cost_error(schema)) is not None:
        raise bad_request(f"{param}: {why}", param, code="schema_too_complex")
    if (why := unsatisfiable(schema)) is not None:
        raise bad_request(f"{param}: {why}", param, code="unsatisfiable_schema")


@dataclass(frozen=True)
class Features:
    """What a chat request asks of the decoder beyond sampling: an output format, tools and how to use them."""

    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)


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
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
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

    def num_images(self) -> int:
        return sum(isinstance(p, ImagePart) for m in self.messages if isinstance(m.content, list) for p in m.content)

    def num_videos(self) -> int:
        return sum(isinstance(p, VideoURLPart) for m in self.messages if isinstance(m.content, list)
                   for p in m.content)

    def num_audios(self) -> int:
        return sum(isinstance(p, (InputAudioPart, AudioURLPart)) for m in self.messages if isinstance(m.content, list)
                   for p in m.content)

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
        fmt = self.response_format
        response_format = None
        if isinstance(fmt, FormatJsonObject) or (isinstance(fmt, FormatJsonSchema) and fmt.json_schema.schema_ is None):
            response_format = ResponseFormat(type="json_object")  # a json_schema without a schema: any JSON object
        elif isinstance(fmt, FormatJsonSchema):
            _schema_fits(fmt.json_schema.schema_, "response_format")
            response_format = ResponseFormat(type="json_schema", json_schema=fmt.json_schema.schema_,
                                             strict=bool(fmt.json_schema.strict))
        tools = self.tools or []
        for i, tool in enumerate(tools):
            _schema_fits(tool.function.parameters, f"tools.{i}.function.parameters")
        names = {t.function.name for t in tools}
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if tools else "none")
        if not tools and choice != "none":
            raise bad_request("tool_choice: only allowed when tools are specified", "tool_choice",
                              code="invalid_request")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(f"tool_choice: no function named {choice.function.name!r} in tools", "tool_choice",
                              code="invalid_request")
        parallel = self.parallel_tool_calls is not False
        tool_choice = ToolChoice(mode="function", name=choice.function.name, parallel=parallel) \
            if isinstance(choice, NamedToolChoice) else ToolChoice(mode=choice, parallel=parallel)
        return Features(response_format, [t.model_dump(exclude_none=True) for t in tools], tool_choice)

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
                if isinstance(part, (ImagePart, InputAudioPart, AudioURLPart)) and (bad := part.unsupported()):
                    return f"messages.{i}.content.{j}.{bad[0]}", bad[1]
        return None


class InstanceRequest(BaseModel):
    """POST/DELETE /instances: a worker to add or remove."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["encoder", "decoder", "prefill"]
    url: Annotated[str, Field(pattern=r"^https?://[^\s/]+$", max_length=512,
                              description="the worker's base URL, e.g. http://10.0.0.7:8001")]
