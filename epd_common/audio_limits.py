"""The bounds one audio clip is held to (`AudioLimits`), the errors a refused clip gets (every one an `AudioError`,
whose message is safe to show a client), and the checks against them that the probe (epd_common/audio.py) and the
decoder (epd_common/audio_decode.py) share: sample format, duration, and what decoding the clip would cost."""
from __future__ import annotations

from dataclasses import dataclass, fields

DECODE_BUDGET_S = 30.0  # an encoder's wall clock for one clip's decode (AudioLimits.max_decode_s)
# One decode's cost, estimated from the probe's packets (decode_cost_s). Measured with decode_audio on this project's
# 2 shared cores under a load average of 12 (docs/SECURITY.md, "Audio input"): each packet's frame goes through the
# decoder, the resampler and numpy, about 80 us of wall clock a packet (35 us of CPU), whatever its size; resampling
# costs about 60 ns a sample of each channel (30 ns of CPU). The estimate takes about twice the loaded wall clock,
# so a clip it passes decodes within the budget on a busy encoder, and any ordinary clip passes with room to spare.
DECODE_S_PER_PACKET = 150e-6
DECODE_S_PER_SAMPLE = 100e-9


def decode_cost_s(packets: int, seconds: float, sample_rate: int, channels: int) -> float:
    """Estimated wall clock of decode_audio on `packets` packets holding `seconds` of audio at `sample_rate` Hz over
    `channels` channels: packet count dominates for tiny frames (a FLAC of 16-sample frames), samples for long clips
    at high rates."""
    return packets * DECODE_S_PER_PACKET + seconds * sample_rate * channels * DECODE_S_PER_SAMPLE


class AudioError(ValueError):
    """The bytes are not audio we accept; the message says why (and is safe to show a client)."""


class NoAudioStreamError(AudioError):
    """The container holds no audio stream (a silent video's, for a video's sound track)."""


class AudioTooLargeError(AudioError):
    """A size, duration or count limit is passed: refused from the headers and packets, or while decoding."""


@dataclass(frozen=True)
class AudioLimits:
    """Server-side bounds on one audio clip."""

    max_bytes: int = 25 << 20  # --max-audio-bytes (OpenAI's audio upload cap is 25 MB)
    max_seconds: float = 600.0  # --max-audio-seconds
    max_channels: int = 8
    min_sample_rate: int = 1000
    max_sample_rate: int = 384_000
    max_streams: int = 4  # all streams of the container (cover art included)
    max_decode_s: float = DECODE_BUDGET_S  # wall clock of the probe's demux pass, or of one decode
    # what one decode on an encoder may cost (its max_decode_s): a clip whose decode the probe estimates past it is
    # refused before it is sent (the proxy probes with a shorter max_decode_s of its own, and this default)
    decode_budget_s: float = DECODE_BUDGET_S

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"AudioLimits.{f.name} must be > 0, got {getattr(self, f.name)!r}")
        if self.min_sample_rate > self.max_sample_rate:
            raise ValueError("AudioLimits.min_sample_rate must be <= max_sample_rate")


def check_format(sample_rate: int, channels: int, limits: AudioLimits) -> None:
    """Refuse a sample rate or channel count outside the limits (declared by a header or given by a decoder)."""
    if not limits.min_sample_rate <= sample_rate <= limits.max_sample_rate:
        raise AudioError(f"audio sample rate is {sample_rate} Hz; it must be "
                         f"{limits.min_sample_rate}..{limits.max_sample_rate} Hz")
    if channels < 1:
        raise AudioError(f"audio has {channels} channels")
    if channels > limits.max_channels:
        raise AudioTooLargeError(f"audio has {channels} channels; the limit is {limits.max_channels}")


def check_duration(duration_s: float, limits: AudioLimits, what: str = "lasts") -> None:
    if not duration_s <= limits.max_seconds:  # also refuses NaN
        raise AudioTooLargeError(f"audio {what} {duration_s:.1f} s; the limit is {limits.max_seconds:g} s")


def check_decode_cost(packets: int, seconds: float, sample_rate: int, channels: int, limits: AudioLimits) -> None:
    """Refuse a clip whose decode (estimated by decode_cost_s from what the probe has read so far) passes the
    encoders' budget."""
    cost = decode_cost_s(packets, seconds, sample_rate, channels)
    if cost > limits.decode_budget_s:
        frame = seconds * sample_rate / packets
        raise AudioTooLargeError(
            f"audio would take more than {limits.decode_budget_s:g} s to decode, the limit of one clip's decode: "
            f"{packets} packets of {frame:.0f} samples at {sample_rate} Hz x {channels} channel(s) so far (estimated "
            f"{DECODE_S_PER_PACKET * 1e6:g} us a packet, {DECODE_S_PER_SAMPLE * 1e9:g} ns a sample): send it in "
            "longer frames, at a lower sample rate or shorter")
