"""A validated chat request -> decoder messages (one image marker per image) + the images, hashed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epd_common.errors import APIError, bad_request
from epd_contracts.hashing import mm_hash
from epd_contracts.sampling import SamplingParams
from proxy.config import ProxyConfig
from proxy.media import load_image_bytes
from proxy.protocol import ChatCompletionRequest, ImagePart
from scheduler.scheduler import MMItem


@dataclass(frozen=True)
class PreparedChat:
    messages: list[dict[str, Any]]  # image parts replaced by {"type": "image"}
    items: list[MMItem]  # images in order of appearance (may repeat)
    sampling: SamplingParams  # the decoder's sampling contract


def check_model(req: ChatCompletionRequest, served: str | None) -> None:
    """404 unless `model` is the served name (None: no worker has said what it serves yet, nothing to check)."""
    if served is not None and req.model != served:
        raise APIError(404, f"model {req.model!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def _check_image_count(req: ChatCompletionRequest, cfg: ProxyConfig) -> None:
    """Counted before anything is fetched or decoded, so a request with 300 images costs nothing."""
    num_images = req.num_images()
    if num_images > cfg.max_images_per_request:
        raise bad_request(f"request has {num_images} images; the maximum is {cfg.max_images_per_request}",
                          param="messages", code="too_many_images")


def _render_messages(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Decoder messages with an image marker per image, and the (param, url) of each image in order.

    No I/O: the whole request is checked for shape before the first image is fetched.
    """
    messages: list[dict[str, Any]] = []
    images: list[tuple[str, str]] = []
    for i, msg in enumerate(req.messages):
        if not isinstance(msg.content, list):
            messages.append({"role": msg.role, "content": msg.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            if isinstance(part, ImagePart):
                if msg.role != "user":
                    raise bad_request("images are only allowed in user messages", f"messages.{i}.content.{j}")
                images.append((f"messages.{i}.content.{j}.image_url.url", part.image_url.url))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part.text})
        messages.append({"role": msg.role, "content": parts})
    return messages, images


def _load_images(images: list[tuple[str, str]], cfg: ProxyConfig, deadline: float | None) -> list[MMItem]:
    """Fetch and check each image (a URL repeated in the request is fetched once), hashed server-side."""
    loaded: dict[str, MMItem] = {}
    items: list[MMItem] = []
    for param, url in images:
        if url not in loaded:
            data = load_image_bytes(url, param, cfg, deadline)
            loaded[url] = MMItem(mm_hash=mm_hash(data), data=data)
        items.append(loaded[url])
    return items


def prepare_chat(req: ChatCompletionRequest, cfg: ProxyConfig, deadline: float | None = None) -> PreparedChat:
    """Check the request and load its images; raises APIError (4xx) naming the bad part.

    Blocking (images may be downloaded under cfg's media rules, see proxy.media): run it in a worker thread.
    """
    sampling = req.sampling()  # refuses unsupported fields before any image is fetched
    _check_image_count(req, cfg)
    messages, images = _render_messages(req)
    return PreparedChat(messages=messages, items=_load_images(images, cfg, deadline), sampling=sampling)
