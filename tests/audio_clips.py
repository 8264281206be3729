"""Audio clips built with PyAV for the audio tests: tones, silence, many streams, and hand-made WAV headers."""
from __future__ import annotations

import math
import os
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any, cast

import av
import numpy as np
import pytest

# name -> (PyAV output format, encoder, the codec probe_audio names, the container probe_audio names)
FORMATS = {
    "wav": ("wav", "pcm_s16le", "pcm_s16le", "wav"),
    "mp3": ("mp3", "libmp3lame", "mp3", "mp3"),
    "flac": ("flac", "flac", "flac", "flac"),
    "ogg-vorbis": ("ogg", "libvorbis", "vorbis", "ogg"),
    "ogg-opus": ("ogg", "libopus", "opus", "ogg"),
    "m4a": ("ipod", "aac", "aac", "mp4"),
    "webm": ("webm", "libopus", "opus", "matroska"),
}
# allowed containers carrying a codec they may not, and containers outside the allow-list
REFUSED = {
    "mkv-flac": ("matroska", "flac", "flac", "matroska"),
    "mp4-mp3": ("mp4", "libmp3lame", "mp3", "mp4"),
    "wav-alaw": ("wav", "pcm_alaw", "pcm_alaw", "wav"),
    "adts": ("adts", "aac", "aac", ""),
    "aiff": ("aiff", "pcm_s16be", "pcm_s16be", ""),
    "au": ("au", "pcm_s16be", "pcm_s16be", ""),
}
_FALLBACK = {"libvorbis": "vorbis", "libopus": "opus"}  # FFmpeg's own encoders, where the library ones are missing


@dataclass(frozen=True)
class Clip:
    """What make_audio builds: `num_streams` identical audio streams of a tone (or silence)."""

    name: str = "wav"  # a key of FORMATS or REFUSED
    seconds: float = 1.0
    rate: int = 0  # 0: 48 kHz for Opus (it has no 44.1 kHz), else 44.1 kHz
    channels: int = 2
    freq: float = 440.0
    num_streams: int = 1
    silence: bool = False
    frame_size: int = 0  # samples per encoded frame; 0: the encoder's
    container_options: dict[str, str] = field(default_factory=dict)


def encoder_for(name: str) -> str:
    """The encoder that builds format `name` here; skips the test when this PyAV build has none."""
    encoder = {**FORMATS, **REFUSED}[name][1]
    for candidate in (encoder, _FALLBACK.get(encoder)):
        if candidate and _has_encoder(candidate):
            return candidate
    pytest.skip(f"this PyAV build has no {encoder} encoder for {name}")


def _has_encoder(name: str) -> bool:
    try:
        av.Codec(name, "w")
    except (av.FFmpegError, ValueError):
        return False
    return True


def tone(seconds: float, rate: int, channels: int, freq: float = 440.0) -> np.ndarray:
    """float32 (channels, samples): a sine at `freq` Hz, amplitude 0.5, the same on every channel."""
    t = np.arange(round(seconds * rate)) / rate
    return np.tile(0.5 * np.sin(2 * math.pi * freq * t), (channels, 1)).astype(np.float32)


def make_audio(name: str = "wav", **kwargs: Any) -> bytes:
    """The bytes of Clip(name, **kwargs), written to a file (MP4's faststart rewrites it)."""
    clip = Clip(name, **kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "clip")
        _write(path, clip)
        with open(path, "rb") as f:
            return f.read()


def _write(path: str, clip: Clip) -> None:
    container = {**FORMATS, **REFUSED}[clip.name][0]
    encoder = encoder_for(clip.name)
    rate = clip.rate or (48_000 if "opus" in encoder else 44_100)
    with av.open(path, "w", format=container, options=clip.container_options) as out:
        streams = [_add_stream(out, encoder, rate, clip) for _ in range(clip.num_streams)]
        chunk, total = clip.frame_size or rate // 10, round(clip.seconds * rate)
        pcm = None if clip.silence else tone(clip.seconds, rate, clip.channels, clip.freq)
        for start in range(0, total, chunk):
            n = min(chunk, total - start)
            samples = np.zeros((clip.channels, n), np.float32) if pcm is None else pcm[:, start:start + n]
            for stream, resampler in streams:
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp",
                                                   layout=_layout(clip.channels))
                frame.sample_rate, frame.pts = rate, start
                for piece in resampler.resample(frame):
                    out.mux(stream.encode(piece))
        for stream, resampler in streams:
            for piece in resampler.resample(None):
                out.mux(stream.encode(piece))
            out.mux(stream.encode(None))


def _layout(channels: int) -> str:
    return {1: "mono", 2: "stereo"}.get(channels, f"{channels}c")


def _add_stream(out: Any, encoder: str, rate: int, clip: Clip) -> tuple[Any, av.AudioResampler]:
    stream = cast(av.AudioStream, out.add_stream(encoder, rate=rate))
    ctx = stream.codec_context
    ctx.layout = _layout(clip.channels)
    ctx.format = ctx.codec.audio_formats[0].name if ctx.codec.audio_formats else "s16"
    ctx.options = {**({"strict": "experimental"} if encoder in ("vorbis", "opus") else {}),
                   **({"frame_size": str(clip.frame_size)} if clip.frame_size else {})}
    ctx.open()
    resampler = av.AudioResampler(format=ctx.format.name, layout=_layout(clip.channels), rate=rate,
                                  frame_size=ctx.frame_size or None)
    return stream, resampler


def hour_of_silence_flac(rate: int = 8000, declare: bool = False) -> bytes:
    """An hour of mono silence in FLAC frames of 65,535 samples (~15 KB at 8 kHz); unless `declare`, its STREAMINFO
    total-samples field is 0 ("unknown"), so only counting the packets tells how long it is."""
    data = bytearray(make_audio("flac", seconds=3600, rate=rate, channels=1, silence=True, frame_size=65535))
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO first: its 34 bytes start at 8
    if not declare:
        fields = int.from_bytes(data[18:26], "big")  # rate (20 bits), channels (3), bits (5), total samples (36)
        data[18:26] = (fields & ~((1 << 36) - 1)).to_bytes(8, "big")
    return bytes(data)


def tiny_frames_flac(num_frames: int, rate: int = 384_000, block: int = 16) -> bytes:
    """A FLAC file of `num_frames` frames of `block` samples of mono 16-bit silence at `rate` Hz, made by hand (an
    encoder takes minutes for 250,000 frames): about 17 bytes a frame, so 4 MB hold 250,000 packets of 16 samples,
    10 s at 384 kHz. Each frame: its header (fixed block size, the block size and the rate in tens of Hz written
    out, its number UTF-8 coded, CRC-8), a CONSTANT subframe of 0, and its CRC-16; the numbers count up, so
    FFmpeg's parser takes every frame as one packet."""
    assert 1 <= block <= 256 and rate % 10 == 0 and rate // 10 < 1 << 16 and num_frames < 1 << 21
    info = struct.pack(">HH", block, block) + bytes(6)  # block sizes; frame sizes unknown
    info += ((rate << 44) | (15 << 36) | (num_frames * block)).to_bytes(8, "big") + bytes(16)  # mono, 16 bits; MD5 0
    out = [b"fLaC", bytes([0x80, 0, 0, len(info)]), info]  # the last metadata block: STREAMINFO
    numbers = np.arange(num_frames, dtype=np.int64)
    widths = np.select([numbers < 0x80, numbers < 0x800, numbers < 0x10000], [1, 2, 3], 4)
    for width in (1, 2, 3, 4):
        n = numbers[widths == width]
        if not n.size:
            continue
        if width == 1:
            coded = [n]
        else:  # UTF-8: a lead byte marking the width, then 6 bits a byte
            lead = (0xFF << (8 - width)) & 0xFF | n >> (6 * (width - 1))
            coded = [lead] + [0x80 | (n >> (6 * k)) & 0x3F for k in range(width - 2, -1, -1)]
        head = np.stack([np.full_like(n, b) for b in (0xFF, 0xF8, 0x6E, 0x08)] + coded  # 8-bit block, 16-bit rate
                        + [np.full_like(n, b) for b in (block - 1, rate // 10 >> 8, rate // 10 & 0xFF)], 1)
        head = np.concatenate([head, _crc(head, 8)[:, None]], 1)
        frame = np.concatenate([head, np.zeros((len(n), 3), np.int64)], 1)  # subframe: CONSTANT, value 0
        crc16 = _crc(frame, 16)
        frames = np.concatenate([frame, (crc16 >> 8)[:, None], (crc16 & 0xFF)[:, None]], 1).astype(np.uint8)
        out.append(frames.tobytes())
    return b"".join(out)


def _crc(rows: np.ndarray, bits: int) -> np.ndarray:
    """FLAC's CRC-8 (x^8+x^2+x+1) or CRC-16 (x^16+x^15+x^2+1) of each row of bytes, all rows at once."""
    poly, top = (0x07, 0x80) if bits == 8 else (0x8005, 0x8000)
    mask = (1 << bits) - 1
    crc = np.zeros(len(rows), np.int64)
    for col in rows.T:
        crc ^= col << (bits - 8)
        for _ in range(8):
            crc = np.where(crc & top, (crc << 1) ^ poly, crc << 1) & mask
    return crc


def _without_id3(data: bytes) -> bytes:
    """MP3 bytes less their leading ID3v2 tag (a tag mid-stream is not audio)."""
    if data[:3] != b"ID3" or len(data) < 10:
        return data
    size = (data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | data[9] & 0x7F  # syncsafe
    return data[10 + size:]


def format_change_mp3(first: tuple[int, int], then: tuple[int, int], seconds: float = 2.0) -> bytes:
    """Two MP3 streams back to back, `seconds` each at (rate, channels) `first` then `then`: the headers (and the
    probe) see the first stream's format, the decoder's frames change it midway."""
    head = make_audio("mp3", seconds=seconds, rate=first[0], channels=first[1])
    return head + _without_id3(make_audio("mp3", seconds=seconds, rate=then[0], channels=then[1]))


def wav_header(sample_rate: int, channels: int = 1, bits: int = 16, data_bytes: int = 0,
               declared_bytes: int | None = None) -> bytes:
    """A PCM WAV file made by hand: its fmt chunk says `sample_rate` and `channels`, its data chunk declares
    `declared_bytes` (default: the real count) and holds `data_bytes` zero bytes."""
    block_align = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 1, channels, sample_rate, (sample_rate * block_align) & 0xFFFFFFFF, block_align, bits)
    declared = data_bytes if declared_bytes is None else declared_bytes
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", declared)
    return b"RIFF" + struct.pack("<I", min(len(body) + declared, 0xFFFFFFFF)) + body + bytes(data_bytes)


def make_video_with_audio(num_frames: int, fps: float, seconds: float, freq: float = 440.0, rate: int = 16_000,
                          width: int = 56, height: int = 56) -> bytes:
    """An MP4 (H.264) of tests.factories.make_video's frames with an AAC sound track of a `seconds` s tone."""
    from fractions import Fraction

    clip = Clip("m4a", seconds=seconds, rate=rate, channels=1, freq=freq)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "video.mp4")
        with av.open(path, "w", format="mp4") as out:
            video = cast(av.VideoStream, out.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000)))
            video.width, video.height, video.pix_fmt = width, height, "yuv420p"
            video.codec_context.options = {"preset": "ultrafast"}
            audio, resampler = _add_stream(out, encoder_for("m4a"), rate, clip)
            for i in range(num_frames):
                pixels = np.full((height, width, 3), 128, np.uint8)
                pixels[height // 4: 3 * height // 4, 4 * i % width: 4 * i % width + 8] = (255, 0, 0)
                out.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
            out.mux(video.encode())
            pcm = tone(seconds, rate, 1, freq)
            for start in range(0, pcm.shape[1], rate // 10):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, start:start + rate // 10]),
                                                   format="fltp", layout="mono")
                frame.sample_rate, frame.pts = rate, start
                for piece in resampler.resample(frame):
                    out.mux(audio.encode(piece))
            for piece in resampler.resample(None):
                out.mux(audio.encode(piece))
            out.mux(audio.encode(None))
        with open(path, "rb") as f:
            return f.read()
