"""Probing untrusted video bytes, with limits checked before any frame is decoded (decoding the sampled frames to RGB:
``epd_common/video_decode.py``).

Mirrors ``epd_common/images.py``: every refusal is a ``VideoError`` (a ValueError whose message is safe to show a
client), and ``VideoTooLargeError`` when a size limit is passed, so a caller maps them to a 400 the way
``proxy/media.py`` maps ImageError/ImageTooLargeError (e.g. ``invalid_video`` / ``video_too_large``).

``probe_video`` checks, in this order, and decodes no frame:

1. the byte count (before FFmpeg sees the bytes);
2. the container, found from the content by FFmpeg's probe but restricted to ALLOWED_CONTAINERS with
   ``format_whitelist``, so PNGs, HLS playlists, concat scripts, ... are refused inside avformat_open_input;
   every nested open a demuxer may ask for is refused (``io_open``), so no container can make FFmpeg read another
   file or URL; ``max_streams`` caps the streams a demuxer creates;
3. the streams: their count, a video stream (cover art does not count), its codec (ALLOWED_CODECS), its declared
   frame size (1..65535 a side, at most ``max_pixels_per_frame``) and its declared duration;
4. a demux-only pass (packets, no decoding, stopped after ``max_scan_frames`` packets or ``max_decode_s``) that
   counts the frames: one packet is one frame for the allowed codecs (old AVI files with MPEG-4 "packed B-frames"
   are the exception: decode_frames refuses the frames they lack). So ``num_frames`` is what the file holds,
   also where the container does not say (Matroska/WebM never do), and a header that claims 10 frames while the
   file holds millions is refused after ``max_scan_frames``.

Unknown duration or frame count: the frame count always comes from the packet count; the frame rate is the
stream's average rate (what transformers' ``read_video_pyav`` uses), else FFmpeg's guess, else frames / declared
duration; a video whose rate cannot be found is refused. ``duration_s`` is ``num_frames / fps``, as in
transformers' ``VideoMetadata``; both the declared and this duration must be within ``max_duration_s``.

Truncated or corrupt files: refused when the header declares more frames than the file holds (MP4/MOV, AVI), when a
packet is flagged corrupt, when the decoder fails, or when it yields fewer frames than asked for. A Matroska/WebM
file cut short (its header declares no frame count) is indistinguishable from a shorter video and is accepted as
the frames it holds; damage the decoder conceals comes back as decoded, as a player would show it.
``decode_frames`` never returns fewer frames than asked for.

FFmpeg's ``max_pixels`` codec option is set on every decoder (also those ``avformat_find_stream_info`` runs), so a
bitstream that declares a larger picture than its container (a VP8 key frame, an H.264 SPS) is refused by libavcodec
before the picture is allocated. Decoding is single-threaded by default (``VideoLimits.num_threads``).

Measured on the development machine (2 cores shared with other work, one decoding thread; libx264 10 s clips at
30 fps with moving gradients, a square and noise): probe_video 4-5 ms; every frame decoded and converted to RGB:
224x224 about 800-1,500 frames/s, 640x480 about 470-650 frames/s (decoding alone: ~7,000 and ~1,300 frames/s);
the 20 frames of fps=2 sampling (every frame decoded up to the last one): 80 ms and 300-370 ms per clip.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any

import av

from epd_common.media_open import AV_ERRORS, check_size, open_media
from epd_common.video_index import FrameIndex, build_index

ALLOWED_CONTAINERS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi"})  # FFmpeg demuxer names
ALLOWED_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg"})
_CODEC_NAMES = {av.Codec(name, "r").id: name for name in ALLOWED_CODECS}  # by id: AV1 is decoded by "libdav1d"
MAX_SIDE = 65535


class VideoError(ValueError):
    """The bytes are not a video we accept; the message says why (and is safe to show a client)."""


class VideoTooLargeError(VideoError):
    """A size limit (bytes, duration, frames, streams, pixels) is passed; refused before the frames are decoded."""


@dataclass(frozen=True)
class VideoLimits:
    """Server-side bounds on one video; per-request settings may only go below them."""

    max_bytes: int = 64 * 1024 * 1024
    max_duration_s: float = 600.0
    max_frames: int = 768  # frames sampled (returned by decode_frames)
    max_pixels_per_frame: int = 1920 * 1080 * 2  # source frame width * height
    max_streams: int = 8  # all streams of the container (audio, subtitles, ... included)
    max_scan_frames: int = 36_000  # frames demuxed or decoded to reach the sampled ones: 600 s at 60 fps
    max_total_pixels: int = 2**27  # width * height summed over the returned frames (~400 MB as RGB)
    max_decode_s: float = 60.0  # wall clock of one probe or one decode
    # frames decoded to reach the asked ones, from the keyframe before each run (epd_common/video_index.py):
    # 48,000 is one pass over a 600 s 60 fps video and a 250-frame GOP for each of 48 runs
    max_decode_frames: int = 48_000
    num_threads: int = 1  # decoder threads (the CPU is shared)

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"VideoLimits.{f.name} must be > 0, got {getattr(self, f.name)!r}")


@dataclass(frozen=True)
class VideoInfo:
    """What probe_video learnt from the headers and the packets (nothing decoded)."""

    width: int
    height: int
    fps: float
    num_frames: int  # counted packets of the video stream
    duration_s: float  # num_frames / fps
    codec: str
    container: str
    # the frames' pts and keyframes (epd_common/video_index.py), from the same demux pass; not compared or shown
    index: FrameIndex = field(default=FrameIndex(0, (), (0,)), repr=False, compare=False)

    @property
    def keyframes(self) -> tuple[int, ...]:
        """Frame indices (presentation order) a decode can start at; (0,) when the index is not usable."""
        return self.index.keyframes


def _open(data: bytes, limits: VideoLimits) -> Any:
    """av.open on the bytes, with only the allowed demuxers and no nested opens (see the module docstring)."""
    check_size(data, limits.max_bytes, "video", VideoError, VideoTooLargeError)
    try:
        return open_media(data, ALLOWED_CONTAINERS, limits.max_streams, limits.max_decode_s,
                          options={"max_pixels": str(limits.max_pixels_per_frame)})
    except AV_ERRORS as exc:
        raise VideoError("cannot identify video data; supported containers: MP4/MOV, Matroska/WebM, AVI") from exc


def _video_stream(container: Any, limits: VideoLimits) -> Any:
    """The first video stream that is not cover art, after the stream-count, codec and frame-size checks."""
    if len(container.streams) > limits.max_streams:
        raise VideoTooLargeError(f"video has more than {limits.max_streams} streams")
    videos = [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
    if not videos:
        raise VideoError("the file has no video stream")
    stream = videos[0]
    if stream.codec_context is None or stream.codec_context.codec.id not in _CODEC_NAMES:
        raise VideoError(f"unsupported video codec {stream.codec.name if stream.codec_context else 'unknown'!r}; "
                         f"allowed: {sorted(ALLOWED_CODECS)}")
    width, height = stream.codec_context.width, stream.codec_context.height
    if width == 0 or height == 0:  # FFmpeg found no size, e.g. its probe refused to decode a frame over max_pixels
        raise VideoError(f"video frame size is unknown or over the limit of {limits.max_pixels_per_frame} pixels")
    check_frame_size(width, height, limits.max_pixels_per_frame)
    return stream


def _codec_name(stream: Any) -> str:
    return _CODEC_NAMES[stream.codec_context.codec.id]


def check_frame_size(width: int, height: int, max_pixels: int) -> None:
    """Refuse a frame size that is absurd (not 1..65535 a side) or over the pixel limit."""
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise VideoError(f"video frame is {width}x{height} pixels; each side must be 1..{MAX_SIDE}")
    if width * height > max_pixels:
        raise VideoTooLargeError(f"video frame is {width}x{height} pixels; the limit is {max_pixels} pixels")


def _declared_duration(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    return container.duration / 1_000_000 if container.duration is not None else None  # AV_TIME_BASE units


def _check_duration(duration_s: float, limits: VideoLimits) -> None:
    if not duration_s <= limits.max_duration_s:  # also refuses NaN
        raise VideoTooLargeError(f"video lasts {duration_s:.1f} s; the limit is {limits.max_duration_s:g} s")


def scan_frames(container: Any, stream: Any, limits: VideoLimits) -> FrameIndex:
    """Demux (no decoding) the video packets, within max_scan_frames and max_decode_s: one frame a packet."""
    deadline = time.monotonic() + limits.max_decode_s
    count = 0
    packets: list[tuple[int | None, bool]] = []
    try:
        for packet in container.demux(stream):
            if packet.is_corrupt:
                raise VideoError(f"corrupt video data at frame {count}")
            if packet.size == 0 or packet.is_discard:  # the end-of-stream packet; edit-list leftovers
                continue
            count += 1
            packets.append((packet.pts, packet.is_keyframe))
            if count > limits.max_scan_frames:
                raise VideoTooLargeError(f"video has more than {limits.max_scan_frames} frames")
            if time.monotonic() > deadline:
                raise VideoTooLargeError("video takes too long to read")
    except VideoError:
        raise
    except AV_ERRORS as exc:
        raise VideoError(f"corrupt video data at frame {count}") from exc
    return build_index(packets)


def _frame_rate(stream: Any, num_frames: int, declared_s: float | None) -> float:
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else (num_frames / declared_s if declared_s else 0.0)
    if not (fps > 0 and math.isfinite(fps)):
        raise VideoError("cannot determine the video's frame rate")
    return fps


def probe_video(data: bytes, limits: VideoLimits | None = None) -> VideoInfo:
    """Check the bytes, headers and packets of a video against `limits`, decoding no frame."""
    limits = limits or VideoLimits()
    with _open(data, limits) as container:
        stream = _video_stream(container, limits)
        declared_s = _declared_duration(container, stream)
        if declared_s is not None:
            _check_duration(declared_s, limits)
        index = scan_frames(container, stream, limits)
        num_frames = index.num_frames
        if num_frames == 0:
            raise VideoError("the video stream has no frames")
        if stream.frames and num_frames < stream.frames:
            raise VideoError(f"video is truncated: its header declares {stream.frames} frames, it holds {num_frames}")
        fps = _frame_rate(stream, num_frames, declared_s)
        _check_duration(num_frames / fps, limits)
        return VideoInfo(width=stream.codec_context.width, height=stream.codec_context.height, fps=fps,
                         num_frames=num_frames, duration_s=num_frames / fps, codec=_codec_name(stream),
                         container=container.format.name, index=index)
