"""Probing untrusted audio bytes, with limits checked before any sample is decoded (decoding and resampling to mono:
``epd_common/audio_decode.py``). numpy-free: the proxy runs it.

Mirrors ``epd_common/video.py``: every refusal is an ``AudioError`` (a ValueError whose message is safe to show a
client; ``invalid_audio``), and ``AudioTooLargeError`` when a size, duration or count limit is passed
(``audio_too_large``).

``probe_audio`` checks, in this order, and decodes no sample of its own (FFmpeg's stream-info probe inside av.open
decodes at most a few packets, within its 5 MB probe size):

1. the declared format (OpenAI ``input_audio.format``: ``wav`` or ``mp3``), if given, is one of those;
2. the byte count: empty, or more than ``max_bytes``, before FFmpeg sees the bytes;
3. the container, found from the content by FFmpeg's probe but restricted to ALLOWED_CONTAINERS with
   ``format_whitelist`` (PNGs, text, playlists, concat scripts, ... are refused inside avformat_open_input); every
   nested open a demuxer may ask for is refused (``io_open``), so no file makes FFmpeg read another file or URL;
   the demuxer may create at most ``max_streams + 1`` streams;
4. the declared format against the container found: mp3 bytes sent as ``wav`` are refused;
5. the streams: at most ``max_streams``; the first audio stream is the one used (others are ignored); its codec is
   one this container may carry (CODECS); its sample rate is within ``min_sample_rate..max_sample_rate`` and its
   channels within ``1..max_channels``;
6. the declared duration (the stream's, else the container's; see 8 for what is declared) is at most
   ``max_seconds``;
7. a demux-only pass over the stream's packets (no decoding, constant memory) sums their durations, stopped as soon
   as the sum passes ``max_seconds`` or the pass passes ``max_decode_s``: an hour of silence in a few KB, whose
   header says nothing (or lies), is refused after reading ``max_seconds`` of packets. A corrupt packet, a packet
   with no duration (other than PCM, counted by its size) or no packet at all is refused;
7b. the same pass estimates what decoding the packets read so far will cost (``decode_cost_s`` in audio_limits.py: per packet and per
   sample of each channel, from measurement) and refuses the clip as soon as it passes ``decode_budget_s``, the
   encoders' decode budget: a 4 MB FLAC of 16-sample frames at 384 kHz (250,000 packets) is refused here, not after
   an encoder has spent its 30 s on it;
8. the counted duration against the declared one: a file that holds less than its header declares (by more than
   ``max(0.05 s, 1 %)``) is truncated. A WAV file declares its length in its data chunk's size (a streamed WAV's
   0 or 0xFFFFFFFF declares none, and is counted to its end); MP3 declares a duration only in a Xing/Info/VBRI header; without one FFmpeg
   guesses it from the bit rate, and that guess is not held against the count. An Ogg file's duration is read
   from its last page, so an Ogg file cut short is accepted as the audio it holds.

``AudioInfo.duration_s`` is the counted duration (it includes the encoder delay and padding of MP3, AAC and Vorbis:
a few tens of ms more than a player shows).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import av

from epd_common.audio_limits import (
    AudioError,
    AudioLimits,
    AudioTooLargeError,
    NoAudioStreamError,
    check_decode_cost,
    check_duration,
    check_format,
)
from epd_common.media_open import AV_ERRORS, check_size, open_media

# FFmpeg demuxer name -> the name AudioInfo.container gives
CONTAINERS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "ogg": "ogg", "mov,mp4,m4a,3gp,3g2,mj2": "mp4",
              "matroska,webm": "matroska"}
ALLOWED_CONTAINERS = frozenset(CONTAINERS)
_PCM = frozenset({"pcm_u8", "pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le", "pcm_f64le"})
# container (AudioInfo.container) -> the codecs it may carry
CODECS: dict[str, frozenset[str]] = {"wav": _PCM, "mp3": frozenset({"mp3"}), "flac": frozenset({"flac"}),
                                     "ogg": frozenset({"vorbis", "opus"}), "mp4": frozenset({"aac"}),
                                     "matroska": frozenset({"opus"})}
_CODEC_NAMES = {av.Codec(name, "r").id: name for names in CODECS.values() for name in names}  # by id: "mp3float"
DECLARED_FORMATS = {"wav": "wav", "mp3": "mp3"}  # OpenAI input_audio.format -> the container it must be


@dataclass(frozen=True)
class AudioInfo:
    """What probe_audio learnt from the headers and the packets (nothing decoded)."""

    container: str  # a key of CODECS: wav, mp3, flac, ogg, mp4 or matroska (WebM included)
    codec: str
    sample_rate: int
    channels: int
    duration_s: float  # counted from the packets, not just declared


def open_audio(data: bytes, limits: AudioLimits) -> Any:
    """av.open on the bytes, with only the allowed demuxers and no nested opens (checks 2-3 of the module doc)."""
    check_size(data, limits.max_bytes, "audio", AudioError, AudioTooLargeError)
    start = time.monotonic()
    try:
        container = open_media(data, ALLOWED_CONTAINERS, limits.max_streams, limits.max_decode_s)
    except av.error.MemoryError as exc:  # what a demuxer gets when it passes max_streams
        raise AudioTooLargeError(f"audio file has more than {limits.max_streams} streams "
                                 "(or a header that needs too much memory)") from exc
    except AV_ERRORS as exc:
        if data[:4] == b"RIFF" and data[8:12] == b"WAVE":  # FFmpeg refuses e.g. a sample rate of 0 while opening
            raise AudioError("invalid WAV header (sample rate, channels or sample format)") from exc
        raise AudioError("cannot identify audio data; supported: WAV, MP3, FLAC, Ogg (Vorbis, Opus), "
                         "M4A/MP4 (AAC), WebM/Matroska (Opus)") from exc
    if time.monotonic() - start > limits.max_decode_s:  # NOTE: the timeout stops FFmpeg's probe, not av.open
        container.close()
        raise AudioTooLargeError("audio takes too long to read")
    return container


def container_name(container: Any) -> str:
    return CONTAINERS[container.format.name]


def audio_stream(container: Any, limits: AudioLimits) -> Any:
    """The first audio stream, after the stream-count, codec, sample-rate and channel checks."""
    if len(container.streams) > limits.max_streams:
        raise AudioTooLargeError(f"audio file has more than {limits.max_streams} streams")
    if not container.streams.audio:
        raise NoAudioStreamError("the file has no audio stream")
    stream = container.streams.audio[0]
    allowed = CODECS[container_name(container)]
    ctx = stream.codec_context
    codec = _CODEC_NAMES.get(ctx.codec.id) if ctx is not None else None
    if codec not in allowed:
        name = ctx.codec.canonical_name if ctx is not None else "unknown"
        raise AudioError(f"unsupported audio codec {name!r} in {container_name(container)}; allowed: {sorted(allowed)}")
    check_format(ctx.sample_rate, ctx.channels, limits)
    return stream


def codec_name(stream: Any) -> str:
    return _CODEC_NAMES[stream.codec_context.codec.id]


def declared_duration(container: Any, stream: Any, data: bytes) -> tuple[float | None, bool]:
    """(seconds the headers declare, else None; whether that is a declaration, not FFmpeg's guess from the bitrate
    or the file size)."""
    name = container_name(container)
    if name == "wav":  # FFmpeg cuts a WAV data size to the file's: the header's own is what a truncation shows
        data_bytes = _wav_data_bytes(data)
        if data_bytes is not None:
            return data_bytes / _pcm_bytes_per_sample(stream) / stream.codec_context.sample_rate, True
    if stream.duration is not None and stream.time_base is not None:
        seconds: float | None = float(stream.duration * stream.time_base)
    else:
        seconds = container.duration / 1_000_000 if container.duration is not None else None  # AV_TIME_BASE units
    # a streamed WAV's length is the file's; an MP3's without a Xing header is guessed from its first frame's bitrate
    guessed = name == "wav" or (name == "mp3" and not _mp3_has_toc(data))
    return seconds, seconds is not None and not guessed


def _wav_data_bytes(data: bytes) -> int | None:
    """The size a RIFF WAV file's data chunk declares; None if it has none or declares none (a streamed WAV's
    0 or 0xFFFFFFFF; RF64)."""
    pos = 12  # after "RIFF", its size and "WAVE"
    for _ in range(64):  # chunks before the data chunk ("fmt ", "LIST", "fact", ...); a file of tiny ones is cut off
        if data[:4] != b"RIFF" or pos + 8 > len(data):
            break
        chunk, size = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "little")
        if chunk == b"data":
            return size if size not in (0, 0xFFFFFFFF) else None
        pos += 8 + size + (size & 1)  # chunks are padded to an even size
    return None


def _mp3_has_toc(data: bytes) -> bool:
    """Whether the first MP3 frame (after an ID3v2 tag) is a Xing, Info or VBRI header, which declares the length."""
    start = 0
    if data[:3] == b"ID3" and len(data) >= 10:
        size = (data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | data[9] & 0x7F  # syncsafe
        start = 10 + size + (10 if data[5] & 0x10 else 0)  # a footer
    head = data[start:start + 64]
    return any(tag in head for tag in (b"Xing", b"Info", b"VBRI"))


def check_counted(counted_s: float, declared_s: float | None, declared: bool) -> None:
    """Refuse audio that holds less than its header declares (a truncated file)."""
    if declared and declared_s is not None and counted_s + max(0.05, 0.01 * declared_s) < declared_s:
        raise AudioError(f"audio is truncated: its header declares {declared_s:.2f} s, it holds {counted_s:.2f} s")


def count_seconds(container: Any, stream: Any, limits: AudioLimits) -> float:
    """Demux (no decoding) the stream's packets and sum their durations, within max_seconds and max_decode_s, and
    the estimated cost of decoding them within decode_budget_s (stopped as soon as it passes: at most
    decode_budget_s / DECODE_S_PER_PACKET packets are read)."""
    deadline = time.monotonic() + limits.max_decode_s
    time_base = float(stream.time_base)
    pcm_bytes = _pcm_bytes_per_sample(stream)  # a PCM packet without a duration is counted by its size
    ctx = stream.codec_context
    ticks = packets = 0
    try:
        for packet in container.demux(stream):
            if packet.size == 0:  # the end-of-stream packet
                continue
            if packet.is_corrupt and not pcm_bytes:  # a PCM packet cut short is only fewer samples
                raise AudioError(f"corrupt or truncated audio data after {ticks * time_base:.2f} s")
            if packet.duration and packet.duration > 0:
                ticks += packet.duration
            elif pcm_bytes:
                ticks += round(packet.size / pcm_bytes / stream.codec_context.sample_rate / time_base)
            else:
                raise AudioError("cannot count the audio's duration: a packet has none")
            check_duration(ticks * time_base, limits, what="lasts more than")
            packets += 1
            check_decode_cost(packets, ticks * time_base, ctx.sample_rate, ctx.channels, limits)
            if time.monotonic() > deadline:
                raise AudioTooLargeError("audio takes too long to read")
    except AudioError:
        raise
    except AV_ERRORS as exc:
        raise AudioError(f"corrupt or truncated audio data after {ticks * time_base:.2f} s") from exc
    if ticks == 0:
        raise AudioError("the audio stream holds no audio")
    return ticks * time_base


def _pcm_bytes_per_sample(stream: Any) -> int:
    """Bytes per sample of all channels for a PCM stream, else 0."""
    name = codec_name(stream)
    if name not in _PCM:
        return 0
    bits = 8 if name == "pcm_u8" else int(name[5:7])
    return bits // 8 * stream.codec_context.channels


def probe_audio(data: bytes, limits: AudioLimits | None = None, fmt: str | None = None) -> AudioInfo:
    """Check the bytes, headers and packets of an audio clip against `limits`, decoding no sample. `fmt`: the format
    the client declared (OpenAI input_audio's "wav" or "mp3"), None when it declared none (audio_url)."""
    limits = limits or AudioLimits()
    if fmt is not None and fmt not in DECLARED_FORMATS:
        raise AudioError(f"unsupported audio format {fmt!r}; allowed: {sorted(DECLARED_FORMATS)}")
    with open_audio(data, limits) as container:
        found = container_name(container)
        if fmt is not None and found != DECLARED_FORMATS[fmt]:
            raise AudioError(f"audio declared as {fmt} is {found} data")
        stream = audio_stream(container, limits)
        declared_s, declared = declared_duration(container, stream, data)
        if declared and declared_s is not None:  # a guess is not refused: the count below tells
            check_duration(declared_s, limits, what="declares")
        counted_s = count_seconds(container, stream, limits)
        check_counted(counted_s, declared_s, declared)
        ctx = stream.codec_context
        return AudioInfo(container=found, codec=codec_name(stream), sample_rate=ctx.sample_rate,
                         channels=ctx.channels, duration_s=counted_s)
