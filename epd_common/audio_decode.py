"""Untrusted audio bytes as float32 mono samples at a model's rate: decoded with PyAV, resampled with
av.AudioResampler (FFmpeg's libswresample), bounded. Runs on the encoders.

`decode_audio` does not trust that the proxy probed the bytes: it runs probe_audio again (epd_common/audio.py: the
bytes, the headers and a demux-only count of the packets' durations; a few ms), then decodes, checking every
decoded frame's sample rate and channels (a bitstream may say other than its container, and may change format
midway: refused) and counting the decoded
seconds: refused as soon as they pass ``max_seconds`` (so the output has at most ``max_seconds * sample_rate``
samples, also where packet durations lie) or the wall clock passes ``max_decode_s``. Memory: one decoded frame at a
time (at most 64 Ki samples a channel for these codecs and WAV's packets) plus the output. A file that decodes to
less than its header declares is refused as truncated.

The channels are resampled as they are, then mixed to mono by their mean (as librosa's ``to_mono``, which the
families' processors expect; libswresample's own stereo downmix is (L + R) / sqrt(2)).
numpy is imported on the first call only: every epd_common module is imported by the proxy, which has no numpy.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import av

from epd_common.audio import audio_stream, check_counted, declared_duration, open_audio, probe_audio
from epd_common.audio_limits import AudioError, AudioLimits, AudioTooLargeError, check_duration, check_format
from epd_common.media_open import AV_ERRORS

if TYPE_CHECKING:
    import numpy as np


def _frames(container: Any, stream: Any, limits: AudioLimits) -> Iterator[Any]:
    """The decoded frames, each checked (rate and channels within the limits, and the same as the first frame's:
    a clip whose header passes and whose later frames change format, two MP3 streams of different rates back to
    back, is refused by name), refused past max_seconds decoded or max_decode_s."""
    deadline = time.monotonic() + limits.max_decode_s
    seconds, first = 0.0, None
    try:
        for frame in container.decode(stream):
            fmt = (frame.sample_rate, frame.layout.nb_channels)
            check_format(*fmt, limits)
            first = first or fmt
            if fmt != first:  # NOTE: the first frame, not the header: HE-AAC decodes at twice its header's rate
                raise AudioError(f"the audio changes format after {seconds:.2f} s: {fmt[0]} Hz, {fmt[1]} channel(s) "
                                 f"where it began at {first[0]} Hz, {first[1]} channel(s)")
            seconds += frame.samples / frame.sample_rate
            check_duration(seconds, limits, what="lasts more than")
            if time.monotonic() > deadline:
                raise AudioTooLargeError("audio takes too long to decode")
            yield frame
    except AudioError:
        raise
    except AV_ERRORS as exc:
        raise AudioError(f"corrupt audio data after {seconds:.2f} s") from exc


def _mono(frame: Any) -> np.ndarray:
    """A planar float frame as one channel: the mean of its channels (as librosa's to_mono)."""
    return frame.to_ndarray().mean(axis=0, dtype="float32")


def decode_audio(data: bytes, sample_rate: int, limits: AudioLimits | None = None) -> np.ndarray:
    """The clip as float32 mono samples at `sample_rate` Hz (1-D, at most max_seconds * sample_rate of them)."""
    import numpy as np

    limits = limits or AudioLimits()
    if not 1 <= sample_rate <= limits.max_sample_rate:
        raise ValueError(f"sample_rate must be 1..{limits.max_sample_rate} Hz, got {sample_rate}")
    probe_audio(data, limits)  # the bytes, headers and packets, before a sample is decoded
    max_samples = math.floor(limits.max_seconds * sample_rate)
    chunks: list[np.ndarray] = []
    decoded_s = 0.0
    with open_audio(data, limits) as container:
        stream = audio_stream(container, limits)
        declared_s, declared = declared_duration(container, stream, data)
        stream.codec_context.thread_count = 1  # the CPU is shared
        resampler = av.AudioResampler(format="fltp", rate=sample_rate)  # the channels kept: mixed below
        try:
            for frame in _frames(container, stream, limits):
                decoded_s += frame.samples / frame.sample_rate
                chunks.extend(_mono(out) for out in resampler.resample(frame))
            chunks.extend(_mono(out) for out in resampler.resample(None))
        except AudioError:
            raise
        except AV_ERRORS as exc:  # e.g. a frame whose layout or rate differs from the first one's
            raise AudioError(f"cannot resample the audio after {decoded_s:.2f} s") from exc
    if decoded_s == 0:
        raise AudioError("the audio stream holds no audio")
    check_counted(decoded_s, declared_s, declared)
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    return samples[:max_samples]  # the resampler's rounding may add a sample or two past the limit
