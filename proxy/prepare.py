"""A validated chat request -> decoder messages (one marker per image, video and audio clip) and its media, each
kind's parts checked, loaded, probed, hashed and planned in chunks by walking the media kinds (proxy/kinds.py)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from epd_common.errors import APIError, bad_request
from epd_common.video_sampling import VideoConfig
from epd_contracts.audio import AudioConfig
from epd_contracts.generate import GenerateRequest, ImageRef, ResponseFormat, ToolChoice
from epd_contracts.hashing import adapter_hash
from epd_contracts.sampling import SamplingParams
from proxy.config import ProxyConfig
from proxy.content_parts import TextPart
from proxy.kinds import KINDS, AnyKind, kind_of, media_counts
from proxy.media_kind import MediaContext, MediaItem, MediaRef, ModelMedia
from proxy.prefix_keys import chat_prefix_keys, prefix_secret
from proxy.protocol import ChatCompletionRequest, Message
from scheduler.scheduler import MMItem

Marked = tuple[MediaItem, ...]  # what one marker of the messages stands for: an item, and what goes in with it


@dataclass(frozen=True)
class PreparedChat:
    """One request as the decoder gets it, less where its images are (that is the generation's part)."""

    messages: list[dict[str, Any]]  # image / video / audio parts replaced by {"type": "image"} / ...; empty for a
    # completions prompt
    items: list[MediaItem]  # images, videos and audio clips in order of appearance (may repeat; a video's sound track
    # after it)
    sampling: SamplingParams  # the decoder's sampling contract
    prompt: str | list[int] | None = None  # /v1/completions: the prompt, instead of messages
    echo: bool = False  # /v1/completions: the prompt comes first in the answer
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    cache_salt: str = ""  # vLLM's cache_salt: no K/V is shared with requests of another salt
    prefix_keys: list[str] = field(default_factory=list)  # proxy/prefix_keys.py: routing, and the decoder's /health
    params: dict[str, str] = field(default_factory=dict)  # mm_hash of each image, video or audio chunk -> its field
    lora: str = ""  # the LoRA adapter the request's `model` names ("" the base model; decoder_service/lora.py)

    @property
    def encodes(self) -> list[MMItem]:
        """What the encoders are asked for: each image, and each chunk of each video and clip, in prompt order."""
        return [c for it in self.items for c in it.chunks]

    def named(self, err: APIError, mm_hash: str) -> APIError:
        """An encoder's error about the item `mm_hash`, naming the request's field of it (not the /encode call's)."""
        param = self.params.get(mm_hash, err.param)
        return APIError(err.status, err.message, param=param, code=err.code, extra=err.extra)

    def request(self, images: list[ImageRef]) -> GenerateRequest:
        return GenerateRequest(messages=self.messages, prompt=self.prompt, echo=self.echo, images=images,
                               sampling=self.sampling, response_format=self.response_format, tools=self.tools,
                               tool_choice=self.tool_choice, cache_salt=self.cache_salt, prefix_keys=self.prefix_keys,
                               lora=self.lora)


def under_vision_adapter(chat: PreparedChat, lora: str) -> PreparedChat:
    """`chat` under an adapter whose weights reach the vision tower: each image is encoded under it and keyed by
    epd_contracts.hashing.adapter_hash (never served under another adapter or the base model). Videos and audio
    under such an adapter are a 400 (the encoders apply it to images only)."""
    from proxy.image import ImageItem

    if any(not isinstance(it, ImageItem) for it in chat.items):
        raise bad_request(f"LoRA adapter {lora!r} changes the vision tower: only images can be sent under it",
                          param="model", code="unsupported_lora_media")
    items: list[MediaItem] = [ImageItem(replace(it.chunk, mm_hash=adapter_hash(it.mm_hash, lora), lora=lora), it.param)
                              for it in chat.items if isinstance(it, ImageItem)]
    return replace(chat, items=items, params={adapter_hash(h, lora): p for h, p in chat.params.items()}, lora=lora)


def check_model(model: str, served: str | None, loras: Iterable[str] = ()) -> str:
    """The LoRA adapter `model` names ("" for the served model itself); 404 unless it is the served name or an
    adapter a decoder serves (None: no worker has said what it serves yet, nothing to check)."""
    if model in loras and model != served:
        return model
    if served is not None and model != served:
        adapters = f" and LoRA adapters {sorted(loras)}" if loras else ""
        raise APIError(404, f"model {model!r} does not exist; this server serves {served!r}{adapters}",
                       param="model", code="model_not_found")
    return ""


def _check_counts(req: ChatCompletionRequest, cfg: ProxyConfig) -> None:
    """Counted before anything is fetched or decoded, so a request with 300 images (or videos) costs nothing."""
    counts = media_counts(req)
    for kind in KINDS:
        if counts[kind.name] > kind.limit(cfg):
            raise bad_request(f"request has {counts[kind.name]} {kind.plural}; the maximum is {kind.limit(cfg)}",
                              param="messages", code=f"too_many_{kind.name}s")


def _tool_fields(i: int, msg: Message) -> dict[str, Any]:
    """An assistant turn's calls and a tool turn's call id, as the chat template reads them (OpenAI's shape)."""
    out: dict[str, Any] = {}
    if msg.tool_calls:
        if msg.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
        out["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
    if msg.role == "tool":
        if not msg.tool_call_id:
            raise bad_request("a tool message needs the tool_call_id of the call it answers",
                              f"messages.{i}.tool_call_id")
        out["tool_call_id"] = msg.tool_call_id
    return out


def _render_messages(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[tuple[AnyKind, MediaRef]]]:
    """Decoder messages with a marker per media part, and each part's kind and checked reference, in order.

    No I/O: the whole request is checked for shape before the first image, video or clip is loaded.
    """
    messages: list[dict[str, Any]] = []
    refs: list[tuple[AnyKind, MediaRef]] = []
    for i, msg in enumerate(req.messages):
        tool = _tool_fields(i, msg)
        if not isinstance(msg.content, list):
            messages.append({"role": msg.role, "content": msg.content or "", **tool})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                continue
            kind, where = kind_of(part), f"messages.{i}.content.{j}"
            if msg.role != "user":
                raise bad_request(kind.only_user, where)
            refs.append((kind, kind.ref(part, where)))
            parts.append({"type": kind.name})
        messages.append({"role": msg.role, "content": parts, **tool})
    return messages, refs


def _load_media(refs: list[tuple[AnyKind, MediaRef]], ctx: MediaContext) -> list[Marked]:
    """What each marker stands for, in prompt order: every kind accepts its parts before any kind loads one; then
    the kinds load theirs in turn."""
    by_kind = {kind: [r for k, r in refs if k is kind] for kind in KINDS}
    settings = {kind: kind.accept(mine, ctx) for kind, mine in by_kind.items() if mine}
    loaded = {kind: iter(_load_kind(kind, by_kind[kind], s, ctx)) for kind, s in settings.items()}
    return [next(loaded[kind]) for kind, _ in refs]


def _load_kind(kind: AnyKind, refs: list[MediaRef], settings: object, ctx: MediaContext) -> list[Marked]:
    """Each distinct part of one kind loaded, probed and planned once (admitted into the request's budget as it
    comes), then the kind's request-wide checks."""
    planned: dict[object, Any] = {}
    for ref in refs:
        key = kind.key(ref)
        if key not in planned:
            data = kind.load(ref, settings, ctx)
            planned[key] = kind.plan(data, kind.probe(data, ref, settings, ctx), ref, settings, ctx)
            kind.admit(list(planned.values()), ctx)
    return kind.settle([planned[kind.key(r)] for r in refs], settings, ctx)


def _params(refs: list[tuple[AnyKind, MediaRef]], marked: list[Marked]) -> dict[str, str]:
    """mm_hash of each image, video chunk and audio chunk -> the request field of its bytes (the first, for a
    repeated one; a sound track's: its video's)."""
    params: dict[str, str] = {}
    for (_, ref), group in zip(refs, marked, strict=True):
        for c in (c for item in group for c in item.chunks):
            params.setdefault(c.mm_hash, ref.param)
    return params


def prepare_chat(req: ChatCompletionRequest, cfg: ProxyConfig, deadline: float | None = None,
                 family: str | None = None, video: VideoConfig | None = None,
                 max_model_len: int | None = None, audio: AudioConfig | None = None,
                 images: bool = True) -> PreparedChat:
    """Check the request and load its images, videos and audio; raises APIError (4xx) naming the bad part. The rest
    is what the fleet's model takes (proxy/media_kind.py ModelMedia): `family` (whether images of a multi-image
    prompt are encoded apart), `video` and `audio` (None: the model takes none, a request with some is a 400 before
    anything is loaded), `max_model_len` (a request whose videos cannot fit is a 400), `images` (False: an audio-only
    family, a request with one is a 400 image_not_supported before anything is loaded).

    Blocking (media may be downloaded under cfg's media rules, see proxy.media; videos and clips are probed): run it
    in a worker thread.
    """
    sampling = req.sampling()  # refuses unsupported fields before any image is fetched
    features = req.features()
    _check_counts(req, cfg)
    messages, refs = _render_messages(req)
    ctx = MediaContext(cfg, ModelMedia(family, images, video, audio, max_model_len), req.mm_processor_kwargs,
                       sampling.max_tokens, deadline)
    marked = _load_media(refs, ctx)
    salt = req.cache_salt or ""
    return PreparedChat(messages=messages, items=[it for group in marked for it in group], sampling=sampling,
                        response_format=features.response_format, tools=features.tools,
                        tool_choice=features.tool_choice, cache_salt=salt, params=_params(refs, marked),
                        prefix_keys=chat_prefix_keys(messages, ["+".join(it.mm_hash for it in group)
                                                                for group in marked],
                                                     features.tools, salt, prefix_secret(cfg.internal_key)))
