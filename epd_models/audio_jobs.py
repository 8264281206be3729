"""An audio item's way into the caching encoder (epd_models/encode.py): checked against this checkpoint, decoded
outside the lock, encoded under it.

The item's AudioPart (epd_contracts/audio.py) must name this checkpoint's rate and window (else 400
audio_plan_mismatch: the proxy planned with another model's settings); the bytes are decoded to float32 mono at that
rate under `limits` (epd_common/audio_decode.py: 400 invalid_audio or audio_too_large), and the job holds the samples
and the windows to encode.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from epd_common.audio_limits import AudioError, AudioLimits, AudioTooLargeError
from epd_contracts.audio import AudioConfig, AudioPart
from epd_models.audio import AudioClip


class UndecodableAudio(AudioError):
    """An item's bytes are not audio this encoder can use as asked; `code` is the 400's error code (invalid_audio,
    audio_too_large, audio_plan_mismatch, audio_not_supported), `mm_hash` names the item."""

    def __init__(self, mm_hash: str, message: str, code: str = "invalid_audio"):
        super().__init__(message)
        self.mm_hash, self.code = mm_hash, code


@dataclass(frozen=True)
class AudioJob:
    """An audio item (a clip, or a chunk of its windows) decoded and waiting for the audio tower; run alone."""

    mm_hash: str
    clip: AudioClip
    part: AudioPart

    @property
    def group(self) -> tuple[str, bool]:
        return "audio", False

    @property
    def seconds(self) -> float:
        return len(self.clip.samples) / self.part.sample_rate


def audio_job(mm_hash: str, data: bytes, part: AudioPart, config: AudioConfig | None, family: str,
              limits: AudioLimits) -> AudioJob:
    """Check the part against this checkpoint's AudioConfig, decode the clip (blocking: outside any lock)."""
    from epd_common.audio_decode import decode_audio

    if config is None:
        raise UndecodableAudio(mm_hash, f"audio input is not supported for {family} checkpoints",
                               "audio_not_supported")
    if part.sample_rate != config.sample_rate or part.window != config.window_seconds:
        raise UndecodableAudio(mm_hash, f"the item was planned at {part.sample_rate} Hz in windows of {part.window} s; "
                                        f"this model takes {config.sample_rate} Hz in windows of "
                                        f"{config.window_seconds} s", "audio_plan_mismatch")
    try:
        samples = decode_audio(data, config.sample_rate, limits)
    except AudioTooLargeError as exc:
        raise UndecodableAudio(mm_hash, str(exc), "audio_too_large") from exc
    except AudioError as exc:
        raise UndecodableAudio(mm_hash, str(exc)) from exc
    return AudioJob(mm_hash, AudioClip(samples, part.first, part.count), part)


DEFAULT_MAX_AUDIO_SECONDS = AudioLimits().max_seconds


def add_audio_flags(p: argparse._ActionsContainer, defaults: Any) -> None:
    """--max-audio-seconds, with the worker config's default (a clip's bytes are bounded by the worker's body cap)."""
    p.add_argument("--max-audio-seconds", type=float, default=defaults.max_audio_seconds,
                   help="seconds an audio clip may last; longer clips get a 400 audio_too_large")


def audio_limits(cfg: Any, max_bytes: int) -> AudioLimits:
    """The AudioLimits of a worker config with max_audio_seconds; `max_bytes`: its cap on one clip's bytes."""
    return AudioLimits(max_bytes=max_bytes, max_seconds=cfg.max_audio_seconds)
