"""An audio clip as an EPD item: what a model that takes audio reports, and the hash its embeddings go under.

Torch-free. A worker whose model takes audio reports its AudioConfig in /health `model_identity["audio"]` (absent
or null: the model takes no audio, and the proxy refuses audio parts before loading anything). The clip's hash
covers its file bytes and the resampling settings (the target rate, mono) under a tag of its own, so a clip never
shares a key with an image or a video of the same bytes, and the same file resampled for another rate never meets
the first one's embeddings.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

AUDIO_HASH_TAG = b"epd-audio-hash/v1\0"
MAX_SAMPLE_RATE = 384_000  # Hz: the highest target rate a config may name


@dataclass(frozen=True)
class AudioConfig:
    """A family's audio settings: the rate its feature extractor takes (clips are resampled to it, mono)."""

    sample_rate: int  # Hz

    def __post_init__(self) -> None:
        rate = self.sample_rate
        if isinstance(rate, bool) or not isinstance(rate, int) or not 1 <= rate <= MAX_SAMPLE_RATE:
            raise ValueError(f"AudioConfig.sample_rate must be an int in 1..{MAX_SAMPLE_RATE}, got {rate!r}")

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
        """The resampling settings as hashed: the target rate, one channel."""
        return f"rate={self.sample_rate};channels=1\0".encode()


def audio_hash(data: bytes, config: AudioConfig) -> str:
    """sha256(tag || settings || data) as lowercase hex (64 characters, like epd_contracts.hashing.mm_hash)."""
    h = hashlib.sha256(AUDIO_HASH_TAG)
    h.update(config.tag())
    h.update(data)
    return h.hexdigest()
