"""A validated chat request -> decoder messages (one image marker per image) + the images, hashed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epd_common.errors import APIError, bad_request
from epd_contracts.generate import Detail, GenerateRequest, ImageRef, ResponseFormat, ToolChoice
from epd_contracts.hashing import mm_hash, multi_image_item
from epd_contracts.sampling import SamplingParams
from proxy.config import ProxyConfig
from proxy.media import load_image_bytes
from proxy.prefix_keys import chat_prefix_keys
from proxy.protocol import ChatCompletionRequest, ImagePart, Message
from scheduler.scheduler import MMItem


@dataclass(frozen=True)
class PreparedChat:
    """One request as the decoder gets it, less where its images are (that is the generation's part)."""

    messages: list[dict[str, Any]]  # image parts replaced by {"type": "image"}; empty for a completions prompt
    items: list[MMItem]  # images in order of appearance (may repeat)
    sampling: SamplingParams  # the decoder's sampling contract
    prompt: str | list[int] | None = None  # /v1/completions: the prompt, instead of messages
    echo: bool = False  # /v1/completions: the prompt comes first in the answer
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    cache_salt: str = ""  # vLLM's cache_salt: no K/V is shared with requests of another salt
    prefix_keys: list[str] = field(default_factory=list)  # proxy/prefix_keys.py: routing, and the decoder's /health

    def request(self, images: list[ImageRef]) -> GenerateRequest:
        return GenerateRequest(messages=self.messages, prompt=self.prompt, echo=self.echo, images=images,
                               sampling=self.sampling, response_format=self.response_format, tools=self.tools,
                               tool_choice=self.tool_choice, cache_salt=self.cache_salt, prefix_keys=self.prefix_keys)


def check_model(model: str, served: str | None) -> None:
    """404 unless `model` is the served name (None: no worker has said what it serves yet, nothing to check)."""
    if served is not None and model != served:
        raise APIError(404, f"model {model!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def _check_image_count(req: ChatCompletionRequest, cfg: ProxyConfig) -> None:
    """Counted before anything is fetched or decoded, so a request with 300 images costs nothing."""
    num_images = req.num_images()
    if num_images > cfg.max_images_per_request:
        raise bad_request(f"request has {num_images} images; the maximum is {cfg.max_images_per_request}",
                          param="messages", code="too_many_images")


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


def _render_messages(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[tuple[str, str, str]]]:
    """Decoder messages with an image marker per image, and the (param, url, detail) of each image in order.

    No I/O: the whole request is checked for shape before the first image is fetched.
    """
    messages: list[dict[str, Any]] = []
    images: list[tuple[str, str, str]] = []
    for i, msg in enumerate(req.messages):
        tool = _tool_fields(i, msg)
        if not isinstance(msg.content, list):
            messages.append({"role": msg.role, "content": msg.content or "", **tool})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            if isinstance(part, ImagePart):
                if msg.role != "user":
                    raise bad_request("images are only allowed in user messages", f"messages.{i}.content.{j}")
                images.append((f"messages.{i}.content.{j}.image_url.url", part.image_url.url,
                               part.image_url.detail or "auto"))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part.text})
        messages.append({"role": msg.role, "content": parts, **tool})
    return messages, images


def _load_images(images: list[tuple[str, str, str]], cfg: ProxyConfig, deadline: float | None,
                 multi_image: bool = False) -> list[MMItem]:
    """Fetch and check each image (a URL repeated in the request is fetched once), hashed server-side; the
    detail is part of the hash ("low" is encoded at another resolution), and so is `multi_image`."""
    loaded: dict[tuple[str, str], MMItem] = {}
    data_of: dict[str, bytes] = {}
    items: list[MMItem] = []
    for param, url, detail in images:
        key: tuple[str, Detail] = (url, "low" if detail == "low" else "auto")
        if key not in loaded:
            if url not in data_of:
                data_of[url] = load_image_bytes(url, param, cfg, deadline)
            data = data_of[url]
            loaded[key] = MMItem(mm_hash=mm_hash(data, key[1], multi_image), data=data, detail=key[1],
                                 multi_image=multi_image)
        items.append(loaded[key])
    return items


def prepare_chat(req: ChatCompletionRequest, cfg: ProxyConfig, deadline: float | None = None,
                 family: str | None = None) -> PreparedChat:
    """Check the request and load its images; raises APIError (4xx) naming the bad part. `family`: the fleet's
    model family (whether images of a multi-image prompt are encoded apart: epd_contracts.hashing).

    Blocking (images may be downloaded under cfg's media rules, see proxy.media): run it in a worker thread.
    """
    sampling = req.sampling()  # refuses unsupported fields before any image is fetched
    features = req.features()
    _check_image_count(req, cfg)
    messages, images = _render_messages(req)
    items = _load_images(images, cfg, deadline, multi_image_item(family, len(images)))
    salt = req.cache_salt or ""
    return PreparedChat(messages=messages, items=items, sampling=sampling,
                        response_format=features.response_format, tools=features.tools,
                        tool_choice=features.tool_choice, cache_salt=salt,
                        prefix_keys=chat_prefix_keys(messages, [it.mm_hash for it in items], features.tools, salt))
