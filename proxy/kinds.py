"""The media kinds the proxy takes (image, video, audio), in the order their parts are checked and loaded, and what
the fleet's model takes of them; a new kind is one module implementing proxy/media_kind.py's MediaKind, listed here."""
from __future__ import annotations

from collections import Counter
from typing import Any

from proxy.audio import AUDIO, fleet_audio_config
from proxy.content_parts import MediaPart
from proxy.image import IMAGE, fleet_takes_images
from proxy.media_kind import MediaKind, ModelMedia
from proxy.protocol import ChatCompletionRequest
from proxy.video import VIDEO, fleet_video_config

AnyKind = MediaKind[Any, Any, Any, Any]
KINDS: tuple[AnyKind, ...] = (IMAGE, VIDEO, AUDIO)
_BY_PART: dict[type, AnyKind] = {part: kind for kind in KINDS for part in kind.parts}


def kind_of(part: MediaPart) -> AnyKind:
    return _BY_PART[type(part)]


def media_counts(req: ChatCompletionRequest) -> Counter[str]:
    """The request's parts of each kind, by its name."""
    return Counter(kind_of(p).name for p in req.media_parts())


def remote_kinds(req: ChatCompletionRequest) -> set[str]:
    """The kinds of the request's http(s) URLs (downloads: they need a fetch slot)."""
    return {kind_of(p).name for p in req.media_parts() if _is_http(kind_of(p).url(p))}


def _is_http(url: str | None) -> bool:
    return url is not None and url[:8].lower().startswith(("http://", "https://"))


def model_media(identity: dict[str, Any] | None, max_model_len: int | None = None) -> ModelMedia:
    """What the fleet's model takes, from its workers' model_identity (None: none reported yet)."""
    return ModelMedia(family=identity.get("family") if identity else None, images=fleet_takes_images(identity),
                      video=fleet_video_config(identity), audio=fleet_audio_config(identity),
                      max_model_len=max_model_len)
