"""An audio clip as an EPD item: what a model that takes audio reports, and the hash its embeddings go under.

Torch-free. A worker whose model takes audio reports its AudioConfig in /health `model_identity["audio"]` (absent
or null: the model takes no audio, and the proxy refuses audio parts before loading anything). The clip's hash
covers its file bytes and the resampling settings (the target rate, mono) under a tag of its own, so a clip never
shares a key with an image or a video of the same bytes, and the same file resampled for another rate never meets
the first one's embeddings.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Annotated, Any

import msgspec

AUDIO_HASH_TAG = b"epd-audio-hash/v1\0"
MAX_SAMPLE_RATE = 384_000  # Hz: the highest target rate a config may name
MAX_WINDOW_SECONDS = 3600.0  # a family's encoder window, on the wire
MAX_AUDIO_WINDOWS = 1 << 16  # windows of one clip, on the wire (a server's --max-audio-seconds bounds them lower)
CHUNK_MARGIN_S = 0.25  # a chunk that is not the last starts this far before the probe's counted end, at least


@dataclass(frozen=True)
class AudioConfig:
    """A family's audio settings: the rate its feature extractor takes (clips are resampled to it, mono), the window
    its encoder encodes independently (0: the whole clip at once, never split), where its processor cuts a clip
    (0: never), and whether it takes a video's sound track interleaved with its frames (`in_video`: Qwen2.5-Omni's
    `use_audio_in_video`, asked for with a request's `mm_processor_kwargs`)."""

    sample_rate: int  # Hz
    window_seconds: float = 0.0
    max_seconds: float = 0.0
    in_video: bool = False

    def __post_init__(self) -> None:
        rate = self.sample_rate
        if isinstance(rate, bool) or not isinstance(rate, int) or not 1 <= rate <= MAX_SAMPLE_RATE:
            raise ValueError(f"AudioConfig.sample_rate must be an int in 1..{MAX_SAMPLE_RATE}, got {rate!r}")
        for name in ("window_seconds", "max_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_WINDOW_SECONDS:
                raise ValueError(f"AudioConfig.{name} must be a number in 0..{MAX_WINDOW_SECONDS}, got {value!r}")
        if not isinstance(self.in_video, bool):
            raise ValueError(f"AudioConfig.in_video must be a bool, got {self.in_video!r}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> AudioConfig:
        """From a worker's /health (ValueError when it is not one)."""
        if not isinstance(data, dict):
            raise ValueError("an audio config must be an object")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"not an audio config: {exc}") from exc

    def tag(self) -> bytes:
        """The resampling settings as hashed: the target rate, one channel (the window does not change the rows: a
        clip's chunks are named by the clip's hash and their windows)."""
        return f"rate={self.sample_rate};channels=1\0".encode()


def audio_hash(data: bytes, config: AudioConfig) -> str:
    """sha256(tag || settings || data) as lowercase hex (64 characters, like epd_contracts.hashing.mm_hash)."""
    h = hashlib.sha256(AUDIO_HASH_TAG)
    h.update(config.tag())
    h.update(data)
    return h.hexdigest()


class AudioPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """EncodeItem.audio / ImageRef.audio: the item's bytes are an audio clip, resampled to `sample_rate` mono, and
    this item is its encoder windows [first, first + count) (a chunk; count 0: from `first` to the clip's end; first
    0 and count 0: the whole clip). `window` is the family's independently encoded window in seconds (0: the clip is
    one window and is never split): the encoder checks it against its own checkpoint's."""

    sample_rate: Annotated[int, msgspec.Meta(ge=1, le=MAX_SAMPLE_RATE)]
    window: Annotated[float, msgspec.Meta(ge=0, le=MAX_WINDOW_SECONDS)] = 0.0
    first: Annotated[int, msgspec.Meta(ge=0, le=MAX_AUDIO_WINDOWS)] = 0
    count: Annotated[int, msgspec.Meta(ge=0, le=MAX_AUDIO_WINDOWS)] = 0

    def __post_init__(self) -> None:
        if (self.first or self.count) and not self.window:
            raise msgspec.ValidationError("a chunk of a clip (first or count set) needs the family's window")

    @property
    def whole(self) -> bool:
        return self.first == 0 and self.count == 0

    @property
    def last(self) -> bool:
        """The chunk runs to the clip's end."""
        return self.count == 0

    def config(self) -> AudioConfig:
        return AudioConfig(sample_rate=self.sample_rate, window_seconds=self.window)


class AudioChunk(msgspec.Struct, frozen=True):
    mm_hash: str  # names this chunk's embeddings
    first: int  # its first window
    count: int  # its windows; 0: to the clip's end


def chunk_hash(clip: str, first: int, count: int) -> str:
    """The mm_hash of windows [first, first + count) of the clip hashed `clip` (count 0: to its end); the whole
    clip's is its own hash."""
    if first == 0 and count == 0:
        return clip
    return hashlib.sha256(AUDIO_HASH_TAG + f"{clip}:{first}:{count}".encode()).hexdigest()


def part_hash(data: bytes, part: AudioPart) -> str:
    """The mm_hash an /encode item with these bytes and this AudioPart is stored under."""
    return chunk_hash(audio_hash(data, part.config()), part.first, part.count)


def plan_chunks(clip: str, seconds: float, window: float, chunk_seconds: float) -> list[AudioChunk]:
    """A clip of about `seconds` (the probe's count, which may be off by an encoder's padding) in chunks of whole
    windows of `window` s, `chunk_seconds` each (rounded down to whole windows, at least one); the last chunk runs to
    the clip's end, so a count a little off never leaves samples out, and every chunk but the last starts at least
    CHUNK_MARGIN_S before the counted end, so none is empty. window 0 (the family never splits) or a clip within one
    chunk: one chunk, the clip's own hash."""
    if window <= 0:
        return [AudioChunk(clip, 0, 0)]
    per = max(1, int(chunk_seconds // window))
    span = per * window
    count = max(1, math.ceil((seconds - CHUNK_MARGIN_S) / span))
    if count == 1:
        return [AudioChunk(clip, 0, 0)]
    return [AudioChunk(chunk_hash(clip, k * per, 0 if k == count - 1 else per), k * per,
                       0 if k == count - 1 else per) for k in range(count)]
