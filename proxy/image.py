"""The image kind: an image_url part -> its bytes (fetched once per URL), checked to be an image we accept (format
allow-list, pixel limit: epd_common.images, headers only), hashed with its detail and whether it is one of several
images of a family that encodes those apart. An image is one chunk: one encoder encodes it.

Error codes (400): image_not_supported (an audio-only model), image_too_large (pixels), invalid_image, too_many_images
(proxy/prepare.py); the URL's own come from proxy.media (invalid_image_url, image_url_forbidden, image_fetch_failed,
image_too_large for bytes, 408 image_fetch_timeout).
"""
from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from epd_common.errors import bad_request
from epd_common.images import ImageError, ImageTooLargeError, open_image
from epd_contracts.generate import Detail, ImageRef
from epd_contracts.hashing import mm_hash, multi_image_item
from proxy.config import ProxyConfig
from proxy.content_parts import ImagePart
from proxy.media import load_media_bytes
from proxy.media_kind import MediaContext, MediaKind, Placement
from proxy.media_rules import MediaBytes
from scheduler.scheduler import MMItem


class ImagePartRef(NamedTuple):
    """An image part of the request, before anything is loaded."""

    part: str  # the request field of the part: messages.<i>.content.<j>
    url: str
    detail: Detail  # image_url.detail: "low", or "auto" (what "high" and none are encoded as)

    @property
    def param(self) -> str:
        return f"{self.part}.image_url.url"


@dataclass(frozen=True)
class ImageItem:
    """One image of a prompt: the scheduler's item (its own one chunk) and the request field of its URL."""

    chunk: MMItem
    param: str = ""

    @property
    def mm_hash(self) -> str:
        return self.chunk.mm_hash

    @property
    def data(self) -> bytes:
        return self.chunk.data

    @property
    def detail(self) -> Detail:
        return self.chunk.detail

    @property
    def multi_image(self) -> bool:
        return self.chunk.multi_image

    @property
    def chunks(self) -> tuple[MMItem, ...]:
        return (self.chunk,)

    def decoder_ref(self, at: Placement) -> ImageRef:
        if at.aggregated:  # the decoder encodes it: send the bytes
            return ImageRef(mm_hash=self.mm_hash, data=base64.b64encode(self.data).decode(), detail=self.detail,
                            multi_image=self.multi_image)
        h = self.mm_hash
        return ImageRef(mm_hash=h, source=at.sources[h], pending=h in at.pending, cached=h in at.cached,
                        detail=self.detail, multi_image=self.multi_image)


@dataclass(frozen=True)
class ImageSettings:
    """How a request's images are loaded: whether each is one of several a family encodes apart, and the bytes of
    each URL fetched so far (a URL repeated with another detail is fetched once)."""

    multi_image: bool
    fetched: dict[str, bytes] = field(default_factory=dict)


def fleet_takes_images(identity: dict[str, Any] | None) -> bool:
    """Whether the fleet's model takes images: False only where its workers say so (model_identity "image": false,
    an audio-only family such as Qwen2-Audio); an identity without the key (an older worker) or none is taken to."""
    return not identity or identity.get("image") is not False


class ImageKind(MediaKind[ImagePartRef, ImageSettings, None, ImageItem]):
    name, plural, parts = "image", "images", (ImagePart,)
    only_user = "images are only allowed in user messages"

    def limit(self, cfg: ProxyConfig) -> int:
        return cfg.max_images_per_request

    def url(self, part: ImagePart) -> str:
        return part.image_url.url

    def ref(self, part: ImagePart, where: str) -> ImagePartRef:
        return ImagePartRef(where, part.image_url.url, "low" if part.image_url.detail == "low" else "auto")

    def accept(self, refs: Sequence[ImagePartRef], ctx: MediaContext) -> ImageSettings:
        """400 image_not_supported naming the first image part when the model takes no image."""
        if not ctx.model.images:
            raise bad_request("this model does not take image input", refs[0].part, code="image_not_supported")
        return ImageSettings(multi_image_item(ctx.model.family, len(refs)))

    def key(self, ref: ImagePartRef) -> object:
        return ref.url, ref.detail

    def load(self, ref: ImagePartRef, settings: ImageSettings, ctx: MediaContext) -> bytes:
        if ref.url not in settings.fetched:
            settings.fetched[ref.url] = load_media_bytes(ref.url, image_bytes(ctx.cfg), ref.param, ctx.cfg,
                                                         ctx.deadline)
        return settings.fetched[ref.url]

    def probe(self, data: bytes, ref: ImagePartRef, settings: ImageSettings, ctx: MediaContext) -> None:
        """400 image_too_large (pixels) or invalid_image unless the headers say an image we accept."""
        try:
            open_image(data, ctx.cfg.max_image_pixels)
        except ImageTooLargeError as exc:
            raise bad_request(str(exc), ref.param, code="image_too_large") from exc
        except ImageError as exc:
            raise bad_request(str(exc), ref.param, code="invalid_image") from exc

    def plan(self, data: bytes, info: None, ref: ImagePartRef, settings: ImageSettings, ctx: MediaContext) -> ImageItem:
        """Hashed server-side: the detail is part of the hash ("low" is encoded at another resolution), and so is
        multi_image."""
        multi = settings.multi_image
        return ImageItem(MMItem(mm_hash(data, ref.detail, multi), data, ref.detail, multi), ref.param)


def image_bytes(cfg: ProxyConfig) -> MediaBytes:
    return MediaBytes("image", cfg.max_image_bytes)


IMAGE = ImageKind()
