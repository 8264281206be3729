"""The hostile audio files of tests/test_audio_probe.py and tests/test_audio_decode.py, each with the refusal it must
get. Built on first use: a format whose encoder this PyAV build lacks skips its case."""
from __future__ import annotations

import io
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from epd_common.audio_limits import AudioError, AudioLimits, AudioTooLargeError
from tests.audio_clips import hour_of_silence_flac, make_audio, tiny_frames_flac, wav_header
from tests.factories import make_image, make_video

NOT_AUDIO = "cannot identify audio data"


@dataclass(frozen=True)
class Hostile:
    make: Callable[[], bytes]
    error: type[AudioError]
    match: str
    limits: AudioLimits = field(default_factory=AudioLimits)


def _png() -> bytes:
    buf = io.BytesIO()
    make_image(32, 32).save(buf, format="PNG")
    return buf.getvalue()


def _half(name: str, **kwargs: object) -> Callable[[], bytes]:
    def make() -> bytes:
        data = make_audio(name, seconds=3, **kwargs)
        return data[:len(data) // 2]
    return make


def _clip(name: str, **kwargs: object) -> Callable[[], bytes]:
    return lambda: make_audio(name, **kwargs)


HOSTILE: dict[str, Hostile] = {
    # not audio, or not audio we take
    "empty": Hostile(lambda: b"", AudioError, "audio is empty"),
    "png": Hostile(_png, AudioError, NOT_AUDIO),
    "text": Hostile(lambda: b"hello, this is not audio\n" * 100, AudioError, NOT_AUDIO),
    "random": Hostile(lambda: random.Random(0).randbytes(4096), AudioError, NOT_AUDIO),
    "hls-playlist": Hostile(lambda: b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n", AudioError, NOT_AUDIO),
    "ffconcat-script": Hostile(lambda: b"ffconcat version 1.0\nfile /etc/passwd\n", AudioError, NOT_AUDIO),
    "video-only": Hostile(lambda: make_video(3), AudioError, "no audio stream"),
    "container-adts": Hostile(_clip("adts"), AudioError, NOT_AUDIO),
    "container-aiff": Hostile(_clip("aiff"), AudioError, NOT_AUDIO),
    "container-au": Hostile(_clip("au"), AudioError, NOT_AUDIO),
    "codec-flac-in-matroska": Hostile(_clip("mkv-flac"), AudioError, "unsupported audio codec 'flac' in matroska"),
    "codec-mp3-in-mp4": Hostile(_clip("mp4-mp3"), AudioError, "unsupported audio codec 'mp3' in mp4"),
    "codec-alaw-in-wav": Hostile(_clip("wav-alaw"), AudioError, "unsupported audio codec 'pcm_alaw' in wav"),
    # cut short
    "truncated-wav": Hostile(_half("wav"), AudioError, "truncated: its header declares 3.00 s, it holds 1.50 s"),
    "truncated-mp3": Hostile(_half("mp3"), AudioError, "truncated: its header declares 3.00 s"),
    "truncated-flac": Hostile(_half("flac"), AudioError, "truncated: its header declares 3.00 s"),
    "truncated-webm": Hostile(_half("webm"), AudioError, "truncated: its header declares 3.01 s"),
    "truncated-m4a": Hostile(_half("m4a", container_options={"movflags": "faststart"}), AudioError,
                             "corrupt or truncated audio data after 1.4"),
    "truncated-m4a-no-index": Hostile(_half("m4a"), AudioError, NOT_AUDIO),  # its moov atom was at the end
    # too many streams
    "50-streams-webm": Hostile(_clip("webm", seconds=0.1, num_streams=50), AudioTooLargeError, "more than 4 streams"),
    "50-streams-m4a": Hostile(_clip("m4a", seconds=0.1, num_streams=50), AudioTooLargeError, "more than 4 streams"),
    "50-streams-ogg": Hostile(_clip("ogg-opus", seconds=0.1, num_streams=50), AudioTooLargeError,
                              "more than 4 streams"),
    # long, and small
    "hour-of-silence": Hostile(hour_of_silence_flac, AudioTooLargeError, "lasts more than 6"),
    "hour-of-silence-declared": Hostile(lambda: hour_of_silence_flac(declare=True), AudioTooLargeError,
                                        "declares 3600.0 s; the limit is 600 s"),
    "wav-declaring-an-hour": Hostile(lambda: wav_header(8000, data_bytes=4000, declared_bytes=8000 * 2 * 3600),
                                     AudioTooLargeError, "declares 3600.0 s; the limit is 600 s"),
    "too-long-declared": Hostile(_clip("flac", seconds=2), AudioTooLargeError, "declares 2.0 s; the limit is 1.5 s",
                                 AudioLimits(max_seconds=1.5)),
    "too-long-counted": Hostile(lambda: wav_header(8000, data_bytes=32_000, declared_bytes=0xFFFFFFFF),
                                AudioTooLargeError, "lasts more than 1.5 s; the limit is 1.5 s",
                                AudioLimits(max_seconds=1.5)),
    "too-many-bytes": Hostile(_clip("wav"), AudioTooLargeError, "audio is 176478 bytes; the limit is 100000 bytes",
                              AudioLimits(max_bytes=100_000)),
    # absurd headers
    "sample-rate-0": Hostile(lambda: wav_header(0, data_bytes=4000), AudioError, "invalid WAV header"),
    "sample-rate-1": Hostile(lambda: wav_header(1, data_bytes=4000), AudioError, "sample rate is 1 Hz; it must be"),
    "sample-rate-999": Hostile(lambda: wav_header(999, data_bytes=4000), AudioError, "sample rate is 999 Hz"),
    "sample-rate-10MHz": Hostile(lambda: wav_header(10_000_000, data_bytes=4000), AudioError,
                                 "sample rate is 10000000 Hz; it must be 1000..384000 Hz"),
    "channels-0": Hostile(lambda: wav_header(16_000, channels=0, data_bytes=4000), AudioError, "has 0 channels"),
    "channels-9": Hostile(lambda: wav_header(16_000, channels=9, data_bytes=9 * 2 * 1000), AudioTooLargeError,
                          "9 channels; the limit is 8"),
    "channels-64": Hostile(lambda: wav_header(16_000, channels=64, data_bytes=64 * 2 * 100), AudioTooLargeError,
                           "64 channels; the limit is 8"),
    # cheap to send, dear to decode: 4 MB of 16-sample FLAC frames at 384 kHz (245,000 packets, 10 s) passed every
    # check above and then held an encoder for its whole 30 s decode budget before this check; its estimated decode cost is
    # refused while the probe counts its packets
    "tiny-frames-flac": Hostile(lambda: tiny_frames_flac(245_000), AudioTooLargeError,
                                "more than 30 s to decode, the limit of one clip's decode: 19[0-9]{4} packets of 16 "
                                "samples at 384000 Hz"),
    "slow": Hostile(_clip("mp3", seconds=5), AudioTooLargeError, "takes too long", AudioLimits(max_decode_s=1e-6)),
}


def hostile_case(name: str) -> tuple[bytes, Hostile]:
    """The bytes of HOSTILE[name] (skipping the test if this PyAV build cannot make them) and the case."""
    case = HOSTILE[name]
    return case.make(), case
