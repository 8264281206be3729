"""A validated chat request -> decoder messages (one image marker per image) + the images, hashed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import APIError, bad_request
from proxy.config import ProxyConfig
from proxy.hashing import mm_hash
from proxy.media import load_image_bytes
from proxy.protocol import ChatCompletionRequest, ImagePart
from scheduler.scheduler import MMItem


@dataclass(frozen=True)
class PreparedChat:
    messages: list[dict[str, Any]]  # image parts replaced by {"type": "image"}
    items: list[MMItem]  # images in order of appearance (may repeat)
    sampling: dict[str, Any]


def _check_supported(req: ChatCompletionRequest, cfg: ProxyConfig) -> None:
    if req.model != cfg.served_model_name:
        raise APIError(404, f"model {req.model!r} does not exist; this server serves {cfg.served_model_name!r}",
                       param="model", code="model_not_found")


def prepare_chat(req: ChatCompletionRequest, cfg: ProxyConfig) -> PreparedChat:
    """Check the request and load its images; raises APIError (4xx) naming the bad part."""
    _check_supported(req, cfg)
    num_images = sum(isinstance(p, ImagePart) for m in req.messages if isinstance(m.content, list) for p in m.content)
    if num_images > cfg.max_images_per_request:
        raise bad_request(f"request has {num_images} images; the maximum is {cfg.max_images_per_request}",
                          param="messages", code="too_many_images")
    messages: list[dict[str, Any]] = []
    items: list[MMItem] = []
    for i, msg in enumerate(req.messages):
        if not isinstance(msg.content, list):
            messages.append({"role": msg.role, "content": msg.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            if isinstance(part, ImagePart):
                if msg.role not in ("user",):
                    raise bad_request("images are only allowed in user messages", f"messages.{i}.content.{j}")
                param = f"messages.{i}.content.{j}.image_url.url"
                data = load_image_bytes(part.image_url.url, param, cfg.max_image_bytes, cfg.max_image_pixels)
                items.append(MMItem(mm_hash=mm_hash(cfg.served_model_name, data), data=data))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part.text})
        messages.append({"role": msg.role, "content": parts})
    return PreparedChat(messages=messages, items=items, sampling=req.sampling())
