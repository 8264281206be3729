"""The one interface every media kind (image, video, audio) implements, and what the kinds share: the model's media
settings, a request's media context, and where a loaded item's embeddings are when the decoder is told.

proxy/prepare.py walks the kinds (proxy/kinds.py) in this order of steps, each kind doing its own part of each:
count its parts → check each part (`ref`) → check the model takes them and the request's settings (`accept`) →
load each distinct one (`load`) → `probe` → hash and plan its chunks over the encoders (`plan`) → the request-wide
checks (`admit` after each, `settle` at the end). Nothing is loaded before every kind accepted its parts.
"""
from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from epd_common.video_sampling import VideoConfig
from epd_contracts.audio import AudioConfig
from epd_contracts.generate import ChunkRef, ImageRef
from proxy.config import ProxyConfig
from proxy.content_parts import MediaPart, MMProcessorKwargs
from scheduler.scheduler import MMItem


@dataclass(frozen=True)
class ModelMedia:
    """What the fleet's model takes, from its workers' /health model_identity (proxy/kinds.py `model_media`)."""

    family: str | None = None  # whether the images of a multi-image prompt are encoded apart (epd_contracts.hashing)
    images: bool = True  # False: an audio-only family
    video: VideoConfig | None = None  # None: the model takes no video
    audio: AudioConfig | None = None  # None: the model takes no audio
    max_model_len: int | None = None  # the longest context among the fleet's decoders (None: unknown)


@dataclass(frozen=True)
class MediaContext:
    """One request's media, as every kind's steps see it."""

    cfg: ProxyConfig
    model: ModelMedia
    kwargs: MMProcessorKwargs | None  # the request's mm_processor_kwargs
    max_tokens: int | None  # the request's max_tokens (a video's context check)
    deadline: float | None  # time.monotonic() by which all of the request's media must be loaded


@dataclass(frozen=True)
class Placement:
    """Where a request's encoded items are, as the decoder's references say: the ZeroMQ address of each mm_hash,
    those still being encoded, those an encoder held already; aggregated: the decoder encodes, references carry
    the bytes."""

    sources: Mapping[str, str]
    pending: frozenset[str]
    cached: frozenset[str]
    aggregated: bool

    def chunk(self, mm_hash: str) -> ChunkRef:
        return ChunkRef(mm_hash=mm_hash, source=self.sources[mm_hash], pending=mm_hash in self.pending,
                        cached=mm_hash in self.cached)


class MediaItem(Protocol):
    """One loaded image, video or clip of a prompt: what the decoder's reference names, and the chunks the scheduler
    places on encoders (an image: itself)."""

    @property
    def mm_hash(self) -> str: ...

    @property
    def data(self) -> bytes: ...

    @property
    def param(self) -> str: ...  # the request field of its bytes (errors name it)

    @property
    def chunks(self) -> tuple[MMItem, ...]: ...

    def decoder_ref(self, at: Placement) -> ImageRef:
        """The decoder's reference to it: where its embeddings are, or (aggregated) its bytes."""
        ...


def chunked_ref(item: MediaItem, at: Placement, **part: Any) -> ImageRef:
    """A video's or clip's reference: its hash and its whole `part`; its embeddings are its chunks' in order
    (aggregated: the file, which the decoder samples or resamples and encodes itself)."""
    if at.aggregated:
        return ImageRef(mm_hash=item.mm_hash, data=base64.b64encode(item.data).decode(), **part)
    return ImageRef(mm_hash=item.mm_hash, chunks=[at.chunk(c.mm_hash) for c in item.chunks], **part)


class MediaRef(Protocol):
    """A media part of the request, checked for shape, before anything is loaded."""

    @property
    def part(self) -> str: ...  # the request field of the part: messages.<i>.content.<j>

    @property
    def param(self) -> str: ...  # the request field of its bytes (errors name it)


RefT = TypeVar("RefT", bound=MediaRef)
SettingsT = TypeVar("SettingsT")
InfoT = TypeVar("InfoT")
ItemT = TypeVar("ItemT", bound=MediaItem)


class MediaKind(Protocol[RefT, SettingsT, InfoT, ItemT]):
    """A media kind's steps. `name` is the decoder's marker ({"type": name}) and the prefix of its error codes."""

    name: str  # "image", "video", "audio"
    plural: str  # the count error's noun: "images", "videos", "audio parts"
    parts: tuple[type[MediaPart], ...]  # the request's content part models of this kind
    only_user: str  # the error for such a part outside a user message

    def limit(self, cfg: ProxyConfig) -> int:
        """The most parts of this kind a request may have (counted before anything else is looked at)."""
        ...

    def url(self, part: Any) -> str | None:
        """The URL the part names (None: its bytes are inline); an http(s) one is a download."""
        ...

    def ref(self, part: Any, where: str) -> RefT:
        """Check the part (no I/O): its reference."""
        ...

    def accept(self, refs: Sequence[RefT], ctx: MediaContext) -> SettingsT:
        """Before anything of any kind is loaded: a 400 <kind>_not_supported naming the first part when the model
        takes none; the request's settings for this kind checked; what loading them needs."""
        ...

    def key(self, ref: RefT) -> object:
        """Parts with the same key are loaded once (a URL repeated in the request)."""
        ...

    def load(self, ref: RefT, settings: SettingsT, ctx: MediaContext) -> bytes:
        """The part's bytes, under the media rules (proxy/media.py) and the kind's byte cap."""
        ...

    def probe(self, data: bytes, ref: RefT, settings: SettingsT, ctx: MediaContext) -> InfoT:
        """Check the bytes are media of this kind we accept, within the limits, without decoding them."""
        ...

    def plan(self, data: bytes, info: InfoT, ref: RefT, settings: SettingsT, ctx: MediaContext) -> ItemT:
        """Hash it and plan its chunks over the encoders."""
        ...

    def admit(self, loaded: Sequence[ItemT], ctx: MediaContext) -> None:
        """After each distinct item is planned: a request-wide budget (a 400 naming the item that passes it)."""
        return None

    def settle(self, items: list[ItemT], settings: SettingsT, ctx: MediaContext) -> list[tuple[MediaItem, ...]]:
        """After all of this kind are loaded (one per part, in order): the request-wide checks, and for each part what
        its marker stands for (the item, and what goes in with it: a video's sound track)."""
        return [(it,) for it in items]
