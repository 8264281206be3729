"""A validated chat request -> decoder messages (one marker per image, video and audio clip) + the images and
videos, hashed (videos planned in chunks: proxy/video.py), and the audio clips, probed (proxy/audio.py)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from epd_common.errors import APIError, bad_request
from epd_common.video_sampling import VideoConfig
from epd_contracts.audio import AudioConfig
from epd_contracts.generate import Detail, GenerateRequest, ImageRef, ResponseFormat, ToolChoice
from epd_contracts.hashing import mm_hash, multi_image_item
from epd_contracts.sampling import SamplingParams
from proxy.audio import AudioItem, AudioRef, audio_ref, audio_support, load_audios, load_tracks, track_support
from proxy.config import ProxyConfig
from proxy.media import image_support, load_image_bytes
from proxy.prefix_keys import chat_prefix_keys, prefix_secret
from proxy.protocol import AudioURLPart, ChatCompletionRequest, ImagePart, InputAudioPart, Message, VideoURLPart
from proxy.video import VideoItem, check_context, check_sampling, load_videos
from scheduler.scheduler import MMItem


@dataclass(frozen=True)
class PreparedChat:
    """One request as the decoder gets it, less where its images are (that is the generation's part)."""

    messages: list[dict[str, Any]]  # image / video parts replaced by {"type": "image"} / {"type": "video"}; empty
    # for a completions prompt
    items: list[MMItem | VideoItem | AudioItem]  # images, videos and audio clips in order of appearance (may repeat)
    sampling: SamplingParams  # the decoder's sampling contract
    prompt: str | list[int] | None = None  # /v1/completions: the prompt, instead of messages
    echo: bool = False  # /v1/completions: the prompt comes first in the answer
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    cache_salt: str = ""  # vLLM's cache_salt: no K/V is shared with requests of another salt
    prefix_keys: list[str] = field(default_factory=list)  # proxy/prefix_keys.py: routing, and the decoder's /health
    params: dict[str, str] = field(default_factory=dict)  # mm_hash of each image, video or audio chunk -> its field

    @property
    def encodes(self) -> list[MMItem]:
        """What the encoders are asked for: each image, and each chunk of each video and clip, in prompt order."""
        return [c for it in self.items for c in (it.chunks if isinstance(it, (VideoItem, AudioItem)) else (it,))]

    def named(self, err: APIError, mm_hash: str) -> APIError:
        """An encoder's error about the item `mm_hash`, naming the request's field of it (not the /encode call's)."""
        param = self.params.get(mm_hash, err.param)
        return APIError(err.status, err.message, param=param, code=err.code, extra=err.extra)

    def request(self, images: list[ImageRef]) -> GenerateRequest:
        return GenerateRequest(messages=self.messages, prompt=self.prompt, echo=self.echo, images=images,
                               sampling=self.sampling, response_format=self.response_format, tools=self.tools,
                               tool_choice=self.tool_choice, cache_salt=self.cache_salt, prefix_keys=self.prefix_keys)


def check_model(model: str, served: str | None) -> None:
    """404 unless `model` is the served name (None: no worker has said what it serves yet, nothing to check)."""
    if served is not None and model != served:
        raise APIError(404, f"model {model!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def _check_media_counts(req: ChatCompletionRequest, cfg: ProxyConfig) -> None:
    """Counted before anything is fetched or decoded, so a request with 300 images (or videos) costs nothing."""
    num_images, num_videos, num_audios = req.num_images(), req.num_videos(), req.num_audios()
    if num_images > cfg.max_images_per_request:
        raise bad_request(f"request has {num_images} images; the maximum is {cfg.max_images_per_request}",
                          param="messages", code="too_many_images")
    if num_videos > cfg.max_videos_per_request:
        raise bad_request(f"request has {num_videos} videos; the maximum is {cfg.max_videos_per_request}",
                          param="messages", code="too_many_videos")
    if num_audios > cfg.max_audios_per_request:
        raise bad_request(f"request has {num_audios} audio parts; the maximum is {cfg.max_audios_per_request}",
                          param="messages", code="too_many_audios")


class MediaRef(NamedTuple):
    """An image or video part of the request, before anything is loaded."""

    kind: str  # "image" or "video"
    part: str  # the request field of the part: messages.<i>.content.<j>
    url: str
    detail: str = "auto"  # image_url.detail

    @property
    def param(self) -> str:
        """The request field of its URL (errors name it)."""
        return f"{self.part}.{self.kind}_url.url"


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


def _render_messages(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[MediaRef | AudioRef]]:
    """Decoder messages with a marker per image, video and audio clip, and each of them in order.

    No I/O: the whole request is checked for shape before the first image, video or clip is loaded.
    """
    messages: list[dict[str, Any]] = []
    media: list[MediaRef | AudioRef] = []
    for i, msg in enumerate(req.messages):
        tool = _tool_fields(i, msg)
        if not isinstance(msg.content, list):
            messages.append({"role": msg.role, "content": msg.content or "", **tool})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            if isinstance(part, (ImagePart, VideoURLPart)):
                kind, where = "image" if isinstance(part, ImagePart) else "video", f"messages.{i}.content.{j}"
                if msg.role != "user":
                    raise bad_request(f"{kind}s are only allowed in user messages", where)
                media.append(MediaRef("image", where, part.image_url.url, part.image_url.detail or "auto")
                             if isinstance(part, ImagePart) else MediaRef("video", where, part.video_url.url))
                parts.append({"type": kind})
            elif isinstance(part, (InputAudioPart, AudioURLPart)):
                if msg.role != "user":
                    raise bad_request("audio is only allowed in user messages", f"messages.{i}.content.{j}")
                media.append(audio_ref(part, f"messages.{i}.content.{j}"))
                parts.append({"type": "audio"})
            else:
                parts.append({"type": "text", "text": part.text})
        messages.append({"role": msg.role, "content": parts, **tool})
    return messages, media


def _load_images(images: list[MediaRef], cfg: ProxyConfig, deadline: float | None,
                 multi_image: bool = False) -> list[MMItem]:
    """Fetch and check each image (a URL repeated in the request is fetched once), hashed server-side; the
    detail is part of the hash ("low" is encoded at another resolution), and so is `multi_image`."""
    loaded: dict[tuple[str, str], MMItem] = {}
    data_of: dict[str, bytes] = {}
    items: list[MMItem] = []
    for image in images:
        param, url, detail = image.param, image.url, image.detail
        key: tuple[str, Detail] = (url, "low" if detail == "low" else "auto")
        if key not in loaded:
            if url not in data_of:
                data_of[url] = load_image_bytes(url, param, cfg, deadline)
            data = data_of[url]
            loaded[key] = MMItem(mm_hash=mm_hash(data, key[1], multi_image), data=data, detail=key[1],
                                 multi_image=multi_image)
        items.append(loaded[key])
    return items


def _load_media(media: list[MediaRef], req: ChatCompletionRequest, cfg: ProxyConfig, deadline: float | None,
                family: str | None, video: VideoConfig | None) -> list[MMItem | VideoItem]:
    """The images and the planned videos, in prompt order; the videos' sampling settings are checked (and a model
    without video refused) before anything is loaded."""
    images = [m for m in media if m.kind == "image"]
    videos = [m for m in media if m.kind == "video"]
    sampling = check_sampling(req.mm_processor_kwargs, video, cfg, videos[0].part) if videos else None
    loaded: dict[str, Iterator[MMItem | VideoItem]] = {"image": iter(_load_images(images, cfg, deadline, multi_image_item(family, len(images)))),
              "video": iter(load_videos([(m.param, m.url) for m in videos], cfg, deadline, sampling) if sampling
                            else [])}
    return [next(loaded[m.kind]) for m in media]


def _params(media: list[MediaRef | AudioRef], items: list[MMItem | VideoItem | AudioItem]) -> dict[str, str]:
    """mm_hash of each image, video chunk and audio chunk -> the request field of its bytes (the first, for a
    repeated one)."""
    params: dict[str, str] = {}
    for ref, item in zip(media, items, strict=True):
        chunks = item.chunks if isinstance(item, (VideoItem, AudioItem)) else (item,)
        for c in chunks:
            params.setdefault(c.mm_hash, ref.param)
    return params


def _in_order(media: list[MediaRef | AudioRef], visual: list[MMItem | VideoItem],
              audios: list[AudioItem]) -> list[MMItem | VideoItem | AudioItem]:
    """The images and videos, and the clips, merged back into prompt order."""
    seen, heard = iter(visual), iter(audios)
    return [next(heard) if isinstance(m, AudioRef) else next(seen) for m in media]


def prepare_chat(req: ChatCompletionRequest, cfg: ProxyConfig, deadline: float | None = None,
                 family: str | None = None, video: VideoConfig | None = None,
                 max_model_len: int | None = None, audio: AudioConfig | None = None,
                 images: bool = True) -> PreparedChat:
    """Check the request and load its images, videos and audio; raises APIError (4xx) naming the bad part. `family`:
    the fleet's model family (whether images of a multi-image prompt are encoded apart: epd_contracts.hashing);
    `video`: the fleet's video settings (None: the model takes no video, a request with one is a 400);
    `max_model_len`: the longest context of the fleet's decoders (a request whose videos cannot fit is a 400);
    `audio`: the fleet's audio settings (None: the model takes no audio, a request with some is a 400 before anything
    is loaded); `images`: whether the model takes images (False: an audio-only family, a request with one is a 400
    image_not_supported before anything is loaded).

    Blocking (media may be downloaded under cfg's media rules, see proxy.media; videos are probed): run it in a
    worker thread.
    """
    sampling = req.sampling()  # refuses unsupported fields before any image is fetched
    features = req.features()
    _check_media_counts(req, cfg)
    messages, media = _render_messages(req)
    audio_refs = [m for m in media if isinstance(m, AudioRef)]
    visual = [m for m in media if isinstance(m, MediaRef)]
    tracks = track_support(req.mm_processor_kwargs, visual, audio)  # before anything is loaded, as audio's
    audio = audio_support(audio_refs, audio)  # a model without audio: 400 before anything is loaded
    image_support([m.part for m in visual if m.kind == "image"], images)  # nor images: the same
    seen = _load_media(visual, req, cfg, deadline, family, video)
    check_context([it for it in seen if isinstance(it, VideoItem)], sampling.max_tokens, max_model_len)
    items = _in_order(media, seen, load_audios(audio_refs, cfg, deadline, audio) if audio is not None else [])
    params, marked = _params(media, items), [it.mm_hash for it in items]
    if tracks is not None:
        items, marked = _with_tracks(items, cfg, tracks, params)
    salt = req.cache_salt or ""
    return PreparedChat(messages=messages, items=items, sampling=sampling,
                        response_format=features.response_format, tools=features.tools,
                        tool_choice=features.tool_choice, cache_salt=salt, params=params,
                        prefix_keys=chat_prefix_keys(messages, marked, features.tools, salt,
                                                     prefix_secret(cfg.internal_key)))


def _with_tracks(items: list[MMItem | VideoItem | AudioItem], cfg: ProxyConfig, config: AudioConfig,
                 params: dict[str, str]) -> tuple[list[MMItem | VideoItem | AudioItem], list[str]]:
    """Each video followed by its sound track (use_audio_in_video), and the hash each marker of the messages stands
    for (a video with its track: both, so its prefix keys differ from the video's alone)."""
    videos = [it for it in items if isinstance(it, VideoItem)]
    found = iter(load_tracks([(v.param, v.data) for v in videos], cfg, config))
    out: list[MMItem | VideoItem | AudioItem] = []
    marked: list[str] = []
    for it in items:
        out.append(it)
        marked.append(it.mm_hash)
        if isinstance(it, VideoItem):
            track = next(found)
            out.append(track)
            marked[-1] += "+" + track.mm_hash
            for c in track.chunks:
                params.setdefault(c.mm_hash, it.param)
    return out, marked
