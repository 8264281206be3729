"""POST /generate (proxy -> decoder) and the NDJSON events the decoder streams back (decoder -> proxy)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from epd_contracts.audio import AudioPart
from epd_contracts.kv import MAX_CHOICES, MAX_GENERATOR_STATE, KVKey
from epd_contracts.limits import MAX_MESSAGES, MAX_TOTAL_PARTS, parts_error
from epd_contracts.sampling import SamplingParams
from epd_contracts.validation import FieldError
from epd_contracts.video import MAX_VIDEO_FRAMES, VideoPart

MAX_HASH_CHARS = 256  # a real mm_hash has 64
MAX_TOOLS = 128  # OpenAI's limit on `tools`
MAX_SCHEMA_BYTES = 64 * 1024  # a response_format or tool schema, as JSON; compiling is bounded by this size
MAX_PROMPT_TOKEN_IDS = 1 << 20  # a /v1/completions prompt given as token ids (the context bounds it again)
MAX_LORA_NAME_CHARS = 256
MAX_CACHE_SALT_CHARS = 256  # vLLM's cache_salt: requests with different salts never share cached K/V
MAX_PREFIX_KEY_CHARS = 64  # one routing key of `prefix_keys` (the proxy sends 32 hex characters)
Detail = Literal["auto", "low", "high"]  # image_url.detail


class ChunkRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """One chunk of a video (epd_contracts/video.py): its hash and where its embeddings are (ImageRef's fields)."""

    mm_hash: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HASH_CHARS)]
    source: str = ""
    pending: bool = False
    cached: bool = False


class ImageRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """One image (or video) of a generate request: its hash, and where its embeddings are (or, aggregated, its
    bytes). A video has `video` set: in EPD mode its embeddings are the rows of its `chunks` in order (empty:
    one chunk, this ref's own mm_hash and source); aggregated, `data` is the video file and the decoder encodes
    frames [0, video.total) itself."""

    mm_hash: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HASH_CHARS)]
    source: str = ""  # ZeroMQ address of the encoder that holds it (EPD mode)
    data: str | None = None  # base64 image file bytes (aggregated mode: the decoder encodes it)
    pending: bool = False  # still being encoded there: the gather waits for it (pipelined mode)
    cached: bool = False  # its embeddings were already held somewhere (not encoded for this request): cached_tokens
    detail: Detail = "auto"  # aggregated mode: the resolution to encode at ("low": the processor's minimum)
    multi_image: bool = False  # encoded as one of several images of its prompt (epd_contracts.hashing)
    video: VideoPart | None = None  # a video: its sampling (whole video: first 0, count = total)
    # an audio clip (epd_contracts/audio.py: its rate and window; the whole clip): in EPD mode its embeddings are the
    # rows of its `chunks` in order (empty: one chunk, this ref's own); aggregated, `data` is the audio file
    audio: AudioPart | None = None
    # an audio clip that is the sound track of the video ref just before it (its data, aggregated, is that video's
    # file): the family interleaves the two (Qwen2.5-Omni's use_audio_in_video), the template writes no placeholder
    in_video: bool = False
    chunks: Annotated[list[ChunkRef], msgspec.Meta(max_length=MAX_VIDEO_FRAMES)] = msgspec.field(
        default_factory=list)

    def __post_init__(self) -> None:
        if self.chunks and self.video is None and self.audio is None:
            raise FieldError("images", "only a video or an audio clip has chunks")
        if self.audio is not None and (self.video is not None or not self.audio.whole):
            raise FieldError("images", "an audio ref names the whole clip (its chunks name their windows) and is no "
                                       "video")
        if self.in_video and self.audio is None:
            raise FieldError("images", "only an audio clip can be a video's sound track (in_video)")


class ResponseFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """OpenAI's response_format, as the decoder enforces it while decoding (decoder_service/grammar.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # json_schema: the JSON Schema the output must match
    strict: bool = False  # OpenAI's json_schema.strict: no properties beyond the schema's


class ToolChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """none: no calls; auto: the model decides; required: at least one call; function: exactly that one (name)."""

    mode: Literal["none", "auto", "required", "function"] = "auto"
    name: str = ""  # mode "function": the function to call
    parallel: bool = True  # OpenAI's parallel_tool_calls: more than one call allowed in one answer


class HandoffChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """One choice at its hand-off: its first token and its sampler's generator state after drawing it (empty:
    greedy, nothing drawn). `first_token` None: the choice ended at its first token on the prefill worker, which
    sent its `done`; the decode worker runs no row for it."""

    first_token: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None
    generator_state: Annotated[bytes, msgspec.Meta(max_length=MAX_GENERATOR_STATE)] = b""
    # the first token's logprobs when its text was held back (a partial character, a possible stop string): they
    # ride on the decode worker's first delta, as they would have on the next delta of one worker
    logprobs: Annotated[list[TokenLogprob], msgspec.Meta(max_length=1)] = msgspec.field(default_factory=list)


class Handoff(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """A request a prefill worker prefilled (E -> P -> D): where its K/V blocks are (`source`, the prefill worker's
    K/V endpoint, under `key`; epd_contracts/kv.py), how many prompt positions they hold, and each choice's state.
    The prefill worker sends it as a `handoff` event; the proxy passes it to the decode worker in /generate, which
    continues the choices (and, if the blocks cannot be had, prefills the prompt itself)."""

    key: KVKey
    source: Annotated[str, msgspec.Meta(max_length=512)] = ""
    num_tokens: Annotated[int, msgspec.Meta(ge=1)]
    choices: Annotated[list[HandoffChoice], msgspec.Meta(min_length=1, max_length=MAX_CHOICES)]
    # usage's cached_tokens of the prefill (what the prefill worker reused of this prompt: its prefix cache, held
    # images): the proxy reports it on the decode worker's `done`s, as one worker would have
    cached_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


class GenerateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """POST /generate; an unknown field is a 400, so a proxy and a decoder that disagree find out at once.

    A chat request has `messages` (rendered by the checkpoint's chat template, with `tools`); a completions request
    (/v1/completions) has `prompt` instead: text tokenized as is, or token ids, and no images.
    """

    # chat messages; image parts are {"type": "image"}, in order of `images`; assistant turns may carry
    # `tool_calls` (OpenAI's shape) and `tool` turns a `tool_call_id`
    messages: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_MESSAGES)] = msgspec.field(
        default_factory=list)
    prompt: str | Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]],
                            msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)] | None = None
    echo: bool = False  # completions: the prompt's text comes first in the output (index 0 delta)
    images: Annotated[list[ImageRef], msgspec.Meta(max_length=MAX_TOTAL_PARTS)] = msgspec.field(default_factory=list)
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    response_format: ResponseFormat | None = None
    # OpenAI's tools: [{"type": "function", "function": {"name", "description", "parameters", "strict"}}]
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_TOOLS)] = msgspec.field(default_factory=list)
    tool_choice: ToolChoice = msgspec.field(default_factory=ToolChoice)
    # prefix caching: K/V reused only between requests with the same salt (vLLM's cache_salt; "" is everyone's)
    cache_salt: Annotated[str, msgspec.Meta(max_length=MAX_CACHE_SALT_CHARS)] = ""
    # the LoRA adapter the request runs under, by its --lora-modules name ("" the base model; decoder_service/lora.py)
    lora: Annotated[str, msgspec.Meta(max_length=MAX_LORA_NAME_CHARS)] = ""
    # routing hints, not trusted for correctness: the proxy's key of each message prefix (messages[:1], [:2], ...),
    # which the decoder reports in /health while it holds the K/V of a request that carried them
    prefix_keys: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PREFIX_KEY_CHARS)]],
                           msgspec.Meta(max_length=MAX_MESSAGES)] = msgspec.field(default_factory=list)
    # E -> P -> D: to a prefill worker, `handoff_key` (prefill, sample each choice's first token, keep the K/V under
    # this key and end with a `handoff` event); to a decode worker, `handoff` (continue what a prefill worker began)
    handoff_key: KVKey | None = None
    handoff: Handoff | None = None

    def __post_init__(self) -> None:
        """The proxy's caps on content parts, held again here (a caller may reach /generate directly)."""
        if (self.prompt is None) == (not self.messages):
            raise FieldError("messages", "give either `messages` (chat) or `prompt` (completions), not both")
        if self.prompt is not None and self.images:
            raise FieldError("images", "a completions prompt has no images")
        if self.echo and self.prompt is None:
            raise FieldError("echo", "echo is for completions prompts")
        error = parts_error([len(c) if isinstance(c := m.get("content"), list) else 0 for m in self.messages])
        if error:
            raise FieldError("messages", error)
        if self.handoff_key is not None and self.handoff is not None:
            raise FieldError("handoff", "a request is either prefilled for a hand-off or continued from one")
        if self.handoff is not None and len(self.handoff.choices) != self.sampling.n:
            raise FieldError("handoff", f"{len(self.handoff.choices)} hand-off choices for n = {self.sampling.n}")


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """One choice's tokens (a request with n choices sends n; the prompt is counted once)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    num_image_tokens: int = 0
    # prompt tokens not computed for this request: K/V reused from the prefix cache, plus the tokens of images past
    # that prefix whose embeddings were already held (their vision work was skipped)
    cached_tokens: int = 0


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str  # the token's text (may be part of a character: then `bytes` holds its real bytes)
    logprob: float  # finite: -inf is sent as -9999.0, as OpenAI does
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """One chosen token: its logprob and the top alternatives (OpenAI's ChatCompletionTokenLogprob)."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ToolCallDelta(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """A piece of a tool call, as OpenAI streams it: the first piece of call `index` has its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""  # the next characters of the arguments' JSON text


class Event(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One NDJSON line: a delta, a choice's `done` (with its usage), or an `error` (ends every choice).

    With n choices the stream interleaves their events (`index`) and ends after n `done`s or an error. A prefill
    worker's stream (`handoff_key`) ends instead with one `handoff` event once every choice has its first token
    (choices that ended there have their `done` before it), or is one `declined` event (`message`: why) when the
    prompt is too short to hand off: the proxy then runs the request on a decode worker.
    """

    type: Literal["delta", "done", "error", "handoff", "declined"]
    index: int = 0  # the choice (0 .. n-1)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per token behind this delta (sampling.logprobs is set)
    tool_calls: list[ToolCallDelta] | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    usage: Usage | None = None
    message: str | None = None
    # an error that is the request's own (a 4xx: a schema whose output cannot be completed), not the server's: its
    # status, code and the param it names; without `status` an error is the server's (the proxy's 502)
    status: Annotated[int, msgspec.Meta(ge=400, le=499)] | None = None
    code: str | None = None
    param: str | None = None
    handoff: Handoff | None = None  # a `handoff` event (prefill worker): where the request continues from
