"""epd_common.audio.probe_audio on good clips and on hostile files: every refusal is an AudioError with its own
message, found from the bytes, headers and packets (nothing decoded), with bounded memory."""
from __future__ import annotations

import math
from typing import Any

import av
import pytest

import epd_common.audio
import epd_common.media_open
from epd_common.audio import probe_audio
from epd_common.audio_limits import (
    DECODE_BUDGET_S,
    DECODE_S_PER_PACKET,
    AudioError,
    AudioLimits,
    AudioTooLargeError,
    decode_cost_s,
)
from tests.audio_clips import FORMATS, make_audio, tiny_frames_flac, wav_header
from tests.audio_hostile import HOSTILE, hostile_case
from tests.hostile.memory import peak_rss_bytes, rss_bytes

MAX_PROBE_GROWTH = 8 * 1024 * 1024  # peak resident memory a refused probe may add


def peak_growth(fn: Any) -> int:
    """Bytes the peak resident memory (VmHWM) grew while fn ran."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident memory to the current one
    before = rss_bytes()
    fn()
    return peak_rss_bytes() - before


# --- good clips ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FORMATS))
def test_each_allowed_container_and_codec_is_probed(name: str) -> None:
    _, _, codec, container = FORMATS[name]
    info = probe_audio(make_audio(name, seconds=2.0))
    rate = 48_000 if codec == "opus" else 44_100
    assert (info.container, info.codec, info.sample_rate, info.channels) == (container, codec, rate, 2)
    assert 2.0 <= info.duration_s < 2.06  # counted: MP3, AAC and Vorbis add their encoder delay and padding


def test_a_declared_format_that_matches_is_accepted() -> None:
    assert probe_audio(make_audio("wav"), fmt="wav").container == "wav"
    assert probe_audio(make_audio("mp3"), fmt="mp3").container == "mp3"


def test_a_streamed_wav_declaring_no_length_is_counted_to_its_end() -> None:
    for size in (0, 0xFFFFFFFF):  # what a WAV writer that cannot seek back leaves
        info = probe_audio(wav_header(8000, data_bytes=16_001, declared_bytes=size))  # a last packet cut short
        assert info.duration_s == pytest.approx(1.0, abs=1e-3)


def test_an_mp3_without_a_xing_header_is_not_held_to_ffmpegs_guess() -> None:
    data = make_audio("mp3", seconds=2.0, container_options={"write_xing": "0"})
    assert b"Xing" not in data[:512] and b"Info" not in data[:512]
    assert probe_audio(data).duration_s == pytest.approx(2.0, abs=0.06)
    assert probe_audio(data[:len(data) // 2]).duration_s == pytest.approx(1.0, abs=0.06)  # nothing declared it


def test_an_ogg_file_cut_short_is_accepted_as_the_audio_it_holds() -> None:
    data = make_audio("ogg-opus", seconds=3)  # Ogg has no length in its header: FFmpeg reads its last page
    assert 0.5 < probe_audio(data[:len(data) // 2]).duration_s <= 1.5  # the whole pages left (about 1 s each)


def test_the_first_audio_stream_is_used_up_to_the_stream_limit() -> None:
    info = probe_audio(make_audio("webm", seconds=0.5, num_streams=4, channels=1))
    assert (info.channels, info.codec) == (1, "opus")


def test_limits_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="max_seconds must be > 0"):
        AudioLimits(max_seconds=0)
    with pytest.raises(ValueError, match="min_sample_rate must be <= max_sample_rate"):
        AudioLimits(min_sample_rate=48_000, max_sample_rate=16_000)


# --- hostile files ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_file_gets_its_own_refusal_with_bounded_memory(name: str) -> None:
    data, case = hostile_case(name)

    def probe() -> None:
        with pytest.raises(case.error, match=case.match):
            probe_audio(data, case.limits)

    probe()  # once before measuring: FFmpeg's first use of a demuxer or codec allocates its tables
    assert peak_growth(probe) < MAX_PROBE_GROWTH


def test_an_hour_of_silence_fits_in_a_few_kilobytes() -> None:
    data, _ = hostile_case("hour-of-silence")
    assert len(data) < 16 * 1024
    with pytest.raises(AudioTooLargeError, match="lasts more than 65.5 s; the limit is 60 s"):
        probe_audio(data, AudioLimits(max_seconds=60))  # counted packet by packet: 65,535 samples (8.2 s) each


@pytest.mark.parametrize(("data", "fmt", "match"), [
    (b"mp3", "wav", "audio declared as wav is mp3 data"),
    (b"wav", "mp3", "audio declared as mp3 is wav data"),
    (b"flac", "wav", "audio declared as wav is flac data"),
    (b"wav", "flac", "unsupported audio format 'flac'; allowed: \\['mp3', 'wav'\\]"),
])
def test_a_file_whose_container_is_not_the_declared_one_is_refused(data: bytes, fmt: str, match: str) -> None:
    with pytest.raises(AudioError, match=match):
        probe_audio(make_audio(data.decode()), fmt=fmt)


@pytest.mark.parametrize(("data", "limits", "error"), [
    (b"", AudioLimits(), AudioError), (bytes(1001), AudioLimits(max_bytes=1000), AudioTooLargeError)])
def test_empty_or_oversized_bytes_never_reach_ffmpeg(monkeypatch: pytest.MonkeyPatch, data: bytes,
                                                      limits: AudioLimits, error: type[AudioError]) -> None:
    def no_open(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("av.open called")
    monkeypatch.setattr(epd_common.audio.av, "open", no_open)
    with pytest.raises(error):
        probe_audio(data, limits)


def test_nested_opens_are_refused() -> None:
    with pytest.raises(PermissionError, match="may not refer to other files"):
        epd_common.media_open.refuse_nested_open("file:///etc/passwd", 0, {})


def test_only_the_allowed_demuxers_are_whitelisted(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    real_open = av.open

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return real_open(*args, **kwargs)
    monkeypatch.setattr(epd_common.audio.av, "open", spy)
    probe_audio(make_audio("wav"))
    names = set(seen["container_options"]["format_whitelist"].split(","))
    assert names == {"wav", "mp3", "flac", "ogg", "mov", "mp4", "m4a", "3gp", "3g2", "mj2", "matroska", "webm"}
    assert seen["io_open"] is epd_common.media_open.refuse_nested_open
    assert seen["container_options"]["max_streams"] == "5"


def test_a_clips_decode_cost_is_estimated_from_its_packets_and_refused_past_the_budget() -> None:
    """The 4 MB FLAC of 16-sample frames at 384 kHz is refused by its packet count, the probe reading no more than the
    budget's worth of packets; the same frames under a budget they fit pass, and so does the same 10 s of audio in
    ordinary 4096-sample frames."""
    data = tiny_frames_flac(245_000)
    assert 4_000_000 < len(data) < 4_200_000
    per_packet = decode_cost_s(1, 16 / 384_000, 384_000, 1)  # a packet and its 16 samples
    assert per_packet < 1.02 * DECODE_S_PER_PACKET  # the packets, not the samples, make the cost
    most = math.ceil(DECODE_BUDGET_S / per_packet)  # packets read before the estimate passes the budget
    with pytest.raises(AudioTooLargeError, match=f"more than {DECODE_BUDGET_S:g} s to decode") as err:
        probe_audio(data)
    read = int(str(err.value).split(": ", 1)[1].split(" packets", 1)[0])
    assert most - 1 <= read <= most + 1
    assert probe_audio(data, AudioLimits(decode_budget_s=60.0)).duration_s == pytest.approx(245_000 * 16 / 384_000)
    assert probe_audio(make_audio("flac", seconds=10, rate=384_000, channels=1, silence=True,
                                  frame_size=4096)).duration_s == pytest.approx(10.0)


@pytest.mark.parametrize(("packets", "seconds", "rate", "channels"), [
    (600 * 48_000 // 960, 600, 48_000, 2),  # Opus in 20 ms frames
    (600 * 48_000 // 1152, 600, 48_000, 2),  # MP3
    (600 * 48_000 // 1024, 600, 48_000, 8),  # AAC, 7.1
    (600 * 192_000 // 4096, 600, 192_000, 2),  # FLAC at 192 kHz
    (25 * 2**20 // 4096, 25 * 2**20 / (384_000 * 8 * 4), 384_000, 8),  # 25 MiB of 32-bit 384 kHz 7.1 WAV
], ids=["opus", "mp3", "aac-7.1", "flac-192k", "wav-384k-7.1"])
def test_ordinary_clips_of_the_longest_allowed_length_fit_the_decode_budget(packets: int, seconds: float, rate: int,
                                                                            channels: int) -> None:
    assert decode_cost_s(packets, seconds, rate, channels) < DECODE_BUDGET_S
