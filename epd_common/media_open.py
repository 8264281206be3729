"""Opening untrusted media bytes with PyAV, as epd_common/video.py and epd_common/audio.py both do: the byte count
checked before FFmpeg sees the bytes, only the allowed demuxers (``format_whitelist``), every nested open a demuxer
may ask for refused (no container can make FFmpeg read another file or URL), and a cap on the streams a demuxer
creates. Each caller maps FFmpeg's errors to its own client-safe ones."""
from __future__ import annotations

import io
from collections.abc import Collection
from typing import Any

import av

AV_ERRORS = (av.FFmpegError, OSError, ValueError, EOFError)  # what opening or demuxing bad bytes raises


def refuse_nested_open(url: str, flags: int, options: dict[str, Any]) -> Any:
    raise PermissionError("a media file may not refer to other files")


def check_size(data: bytes, max_bytes: int, what: str, error: type[ValueError], too_large: type[ValueError]) -> None:
    """Empty: `error`; past `max_bytes`: `too_large` (both with messages safe to show a client)."""
    if not data:
        raise error(f"{what} is empty")
    if len(data) > max_bytes:
        raise too_large(f"{what} is {len(data)} bytes; the limit is {max_bytes} bytes")


def open_media(data: bytes, containers: Collection[str], max_streams: int, timeout: float,
               options: dict[str, str] | None = None) -> Any:
    """av.open on the bytes: only `containers`' demuxers, no nested opens, a demuxer stopped past `max_streams`
    streams (it then raises av.error.MemoryError), FFmpeg's probe stopped after `timeout` seconds."""
    return av.open(io.BytesIO(data), mode="r", options=options or {},
                   container_options={"format_whitelist": ",".join(sorted(containers)),
                                      "max_streams": str(max_streams + 1)},
                   io_open=refuse_nested_open, timeout=timeout)
