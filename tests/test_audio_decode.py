"""epd_common.audio_decode.decode_audio: float32 mono at the asked rate, with the tone's energy; every hostile file
refused as by probe_audio (decode_audio trusts no earlier probe), and its own bounds on what it decodes."""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import epd_common.audio_decode
from epd_common.audio import probe_audio
from epd_common.audio_decode import decode_audio
from epd_common.audio_limits import AudioError, AudioLimits, AudioTooLargeError
from tests.audio_clips import FORMATS, format_change_mp3, hour_of_silence_flac, make_audio, wav_header
from tests.audio_hostile import HOSTILE, hostile_case
from tests.test_audio_probe import peak_growth

MAX_DECODE_GROWTH = 16 * 1024 * 1024  # peak resident memory a refused decode may add


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum)) * rate / len(samples)


def sine_fit(samples: np.ndarray, rate: int, freq: float = 440.0) -> tuple[float, float]:
    """(amplitude, correlation) of the best-fitting sine at `freq` Hz (any phase)."""
    t = np.arange(len(samples)) / rate
    basis = np.stack([np.sin(2 * math.pi * freq * t), np.cos(2 * math.pi * freq * t)], axis=1)
    coef, *_ = np.linalg.lstsq(basis, samples, rcond=None)
    fit = basis @ coef
    return float(np.hypot(*coef)), float(np.corrcoef(fit, samples)[0, 1])


def pcm_wav(left: np.ndarray, right: np.ndarray, rate: int) -> bytes:
    """A 16-bit stereo WAV file of two float channels in -1..1."""
    pcm = (np.stack([left, right], axis=1) * 32767).astype("<i2").tobytes()
    return wav_header(rate, channels=2, data_bytes=len(pcm))[:-len(pcm)] + pcm


def test_a_stereo_tone_becomes_16k_mono_float32_with_its_energy() -> None:
    samples = decode_audio(make_audio("wav", seconds=1.0, rate=44_100, channels=2), 16_000)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - 16_000) <= 2
    amplitude, correlation = sine_fit(samples[200:-200], 16_000)  # the resampler's filter edges left out
    assert amplitude == pytest.approx(0.5, abs=0.01) and correlation > 0.999
    assert peak_hz(samples, 16_000) == pytest.approx(440, abs=2)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_allowed_container_round_trips(name: str) -> None:
    samples = decode_audio(make_audio(name, seconds=1.0), 16_000)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert 16_000 <= len(samples) <= 16_400  # AAC and Vorbis keep some of their encoder delay
    assert peak_hz(samples, 16_000) == pytest.approx(440, abs=2)
    amplitude, correlation = sine_fit(samples[2000:-2000], 16_000)  # the codecs' delay and fades left out
    assert amplitude == pytest.approx(0.5, abs=0.05) and correlation > 0.99


@pytest.mark.parametrize("rate", [8_000, 16_000, 24_000, 48_000])
def test_the_output_has_the_asked_rate(rate: int) -> None:
    samples = decode_audio(make_audio("flac", seconds=0.5, rate=44_100), rate)
    assert abs(len(samples) - rate // 2) <= 2
    assert peak_hz(samples, rate) == pytest.approx(440, abs=4)


def test_channels_are_mixed_to_their_mean() -> None:
    t = np.arange(16_000) / 16_000
    left = 0.5 * np.sin(2 * math.pi * 440 * t)
    samples = decode_audio(pcm_wav(left, np.zeros_like(left), 16_000), 16_000)
    amplitude, _ = sine_fit(samples, 16_000)
    assert amplitude == pytest.approx(0.25, abs=0.005)  # (left + right) / 2, as librosa's to_mono


def test_the_output_never_passes_max_seconds_at_the_asked_rate() -> None:
    data = make_audio("wav", seconds=1.0, rate=44_100)
    assert len(decode_audio(data, 16_000, AudioLimits(max_seconds=1.0))) <= 16_000
    with pytest.raises(AudioTooLargeError, match="limit is 0.5 s"):
        decode_audio(data, 16_000, AudioLimits(max_seconds=0.5))


def test_decode_bounds_its_own_output_where_the_probe_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the packets' durations had lied to the probe: decoding stops past max_seconds, memory bounded."""
    monkeypatch.setattr(epd_common.audio_decode, "probe_audio", lambda *args, **kwargs: None)
    data = hour_of_silence_flac()

    def decode() -> None:
        with pytest.raises(AudioTooLargeError, match="lasts more than 6.\\.. s; the limit is 60 s"):
            decode_audio(data, 16_000, AudioLimits(max_seconds=60))

    decode()
    assert peak_growth(decode) < MAX_DECODE_GROWTH  # 60 s at 16 kHz is 3.8 MB of output


def test_decode_is_refused_past_its_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(epd_common.audio_decode, "probe_audio", lambda *args, **kwargs: None)
    clock = iter(range(0, 10**6, 10))  # every look at decode's clock is 10 s later
    monkeypatch.setattr(epd_common.audio_decode, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    with pytest.raises(AudioTooLargeError, match="takes too long to decode"):
        decode_audio(make_audio("mp3", seconds=2), 16_000, AudioLimits(max_decode_s=15))


@pytest.mark.parametrize("rate", [0, -16_000, 400_000])
def test_an_absurd_output_rate_is_a_server_error_not_a_client_one(rate: int) -> None:
    with pytest.raises(ValueError, match="sample_rate must be") as info:
        decode_audio(make_audio("wav"), rate)
    assert not isinstance(info.value, AudioError)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_file_is_refused_by_decode_too_with_bounded_memory(name: str) -> None:
    data, case = hostile_case(name)

    def decode() -> Any:
        with pytest.raises(case.error, match=case.match):
            decode_audio(data, 16_000, case.limits)

    decode()
    assert peak_growth(decode) < MAX_DECODE_GROWTH


@pytest.mark.parametrize(("first", "then", "match"), [
    ((44_100, 1), (22_050, 1), "changes format after 2.0[0-9] s: 22050 Hz, 1 channel.* began at 44100 Hz, 1 channel"),
    ((44_100, 2), (44_100, 1), "changes format after 2.0[0-9] s: 44100 Hz, 1 channel.* began at 44100 Hz, 2 channel"),
], ids=["rate", "channels"])
def test_frames_that_change_rate_or_channels_after_a_header_that_passes_are_refused(
        first: tuple[int, int], then: tuple[int, int], match: str) -> None:
    """Two MP3 streams back to back: the probe (headers and packets) passes them as the first one's format, and the
    decoder refuses the first frame of the other, by name, with bounded memory."""
    data = format_change_mp3(first, then)
    info = probe_audio(data)
    assert (info.sample_rate, info.channels) == first  # the header passes

    def decode() -> Any:
        with pytest.raises(AudioError, match=match):
            decode_audio(data, 16_000)

    decode()
    assert peak_growth(decode) < MAX_DECODE_GROWTH
