"""epd-bench's audio: WAV clips (16 kHz mono 16-bit PCM, the stdlib `wave` module), each one distinct by construction.

Clip (seed, audio_id) is a tone whose frequency and phase are drawn from (seed, id), after a short header that
spells the seed and the id in binary (one block of samples per bit, high or low): two clips with a different
(seed, id) differ in samples, so never in bytes, and a server's cache can never serve one for the other (a repeat
in the dataset sends the very same bytes on purpose). The length is the caller's, to the sample.
"""
from __future__ import annotations

import base64
import io
import wave

import numpy as np

SAMPLING_RATE = 16000  # what every audio family's feature extractor takes
ID_BITS = 32  # bits of the seed and of the id each that the header writes
BIT_SAMPLES = 16  # samples per header bit: 64 bits are 1024 samples (64 ms)
FORMAT = "wav"  # input_audio.format


def clip_samples(seed: int, audio_id: int, seconds: float, rate: int = SAMPLING_RATE) -> np.ndarray:
    """The clip as int16 samples: round(seconds * rate) of them (the header is cut short on a shorter clip)."""
    if not seconds > 0:
        raise ValueError(f"a clip needs seconds > 0; got {seconds}")
    n = max(1, round(seconds * rate))
    rng = np.random.default_rng([seed & 0xFFFFFFFF, audio_id & 0xFFFFFFFF, 0xA0D10])
    freq, phase = rng.uniform(110.0, 1760.0), rng.uniform(0.0, 2 * np.pi)
    t = np.arange(n, dtype=np.float64) / rate
    samples = (0.3 * 32767 * np.sin(2 * np.pi * freq * t + phase)).astype(np.int16)
    bits = [(seed >> b) & 1 for b in range(ID_BITS)] + [(audio_id >> b) & 1 for b in range(ID_BITS)]
    header = np.repeat(np.array([12000 if bit else -12000 for bit in bits], np.int16), BIT_SAMPLES)[:n]
    samples[:len(header)] = header
    return samples


def make_wav(seed: int, audio_id: int, seconds: float, rate: int = SAMPLING_RATE) -> bytes:
    """The clip as a WAV file (RIFF, PCM 16-bit, mono)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(clip_samples(seed, audio_id, seconds, rate).astype("<i2").tobytes())
    return buf.getvalue()


def wav_base64(seed: int, audio_id: int, seconds: float) -> str:
    """make_wav(...) as base64, the form an `input_audio` part's `data` carries."""
    return base64.b64encode(make_wav(seed, audio_id, seconds)).decode()
