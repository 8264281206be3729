"""A media URL (image, video or audio) -> its bytes, capped at its kind's limit; and a kind's config from the fleet's
model identity.

An image_url, video_url or audio_url may be:

* a ``data:`` URL (base64 payload, media type ``image/*``, ``video/*`` or ``audio/*`` as the part's kind, or none);
* an ``http(s)://`` URL, fetched with an SSRF guard (``proxy/fetch.py``);
* a ``file://`` URL, only when ``ProxyConfig.allowed_local_media_path`` is set and the real path (symlinks
  and ``..`` resolved) lies under it.

Whatever the source, the bytes are capped at the kind's limit (``max_image_bytes``, ``max_video_bytes``,
``max_audio_bytes``) while they are read (never read unbounded); each kind then probes them (``proxy/image.py``,
``proxy/video.py``, ``proxy/audio.py``).
Error codes are the kind's (``image_too_large``, ``invalid_video_url``, ...: ``MediaBytes.error``). Error messages
name the problem and at most the URL's host; resolved addresses and OS errors are not shown.
"""
from __future__ import annotations

import base64
import binascii
import functools
import json
import logging
import os
import re
import stat
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from epd_common.errors import APIError
from proxy.config import ProxyConfig
from proxy.fetch import fetch_http
from proxy.media_rules import MediaBytes, MediaError

logger = logging.getLogger("epd.proxy")

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)


def load_media_bytes(url: str, kind: MediaBytes, param: str, cfg: ProxyConfig, deadline: float | None = None) -> bytes:
    """A media URL's bytes, fetched under cfg's media rules and capped at the kind's byte limit (not yet checked to
    be an image, a video or a clip: each kind's probe does that).

    `deadline` (time.monotonic()) is when all of the request's media must be loaded. Raises APIError 400 with
    `param` and one of the kind's codes: invalid_<kind>_url, <kind>_url_forbidden, <kind>_fetch_failed,
    <kind>_too_large, invalid_<kind> (a server's content type); or 408 <kind>_fetch_timeout when the deadline
    passes during a download.
    """
    try:
        return read_source(url, kind, cfg, deadline)
    except MediaError as exc:
        raise APIError(exc.status, exc.message, param=param, code=exc.code) from exc


def read_source(url: str, kind: MediaBytes, cfg: ProxyConfig, deadline: float | None = None) -> bytes:
    """Dispatch on the URL scheme; anything but data:, http(s): and file: is refused."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_url(url, kind)
    if scheme in ("http", "https"):
        return fetch_http(url, kind, cfg, deadline)
    if scheme == "file":
        return read_file(url, kind, cfg)
    raise kind.error("invalid_url", f"{kind.name}_url.url must be a data:, http(s):// or file:// URL")


# --- data: URLs ---------------------------------------------------------------------------------------------

def decode_data_url(url: str, kind: MediaBytes) -> bytes:
    """data:[<mime>][;base64],<payload> -> bytes, refusing what is malformed, of another media type or too large
    (before decoding)."""
    k = kind.name
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise kind.error("invalid_url", f"{k} data URL must be base64 (data:{k}/<fmt>;base64,...)")
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith(f"{k}/"):
        raise kind.error("invalid_url", f"data URL media type {mime!r} is not {kind.accept}")
    payload = url[m.end():]
    if len(payload) * 3 // 4 > kind.max_bytes:
        raise kind.error("too_large", f"{k} is larger than {kind.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise kind.error("invalid_url", f"{k} data URL is not valid base64: {exc}") from exc


# --- file:// URLs -------------------------------------------------------------------------------------------

def read_file(url: str, kind: MediaBytes, cfg: ProxyConfig) -> bytes:
    """A local file, only from under cfg.allowed_local_media_path (checked on the fully resolved path)."""
    if not cfg.allowed_local_media_path:
        raise kind.error("forbidden", f"file:// {kind.name} URLs are not enabled on this server")
    root = os.path.realpath(cfg.allowed_local_media_path)
    path = os.path.realpath(file_url_path(url, kind))  # symlinks and '..' resolved before the containment check
    if os.path.commonpath([root, path]) != root:
        raise kind.error("forbidden", f"file:// {kind.name} URL is outside the allowed media directory")
    return read_regular_file(path, kind)


def file_url_path(url: str, kind: MediaBytes) -> str:
    """file:///abs/path or file://localhost/abs/path -> /abs/path (percent-decoded); other hosts are refused."""
    parts = urlsplit(url)
    if parts.netloc.lower() not in ("", "localhost"):
        raise kind.error("invalid_url", f"file:// {kind.name} URLs must name a local path (file:///path)")
    path = unquote(parts.path)
    if not path.startswith("/") or "\0" in path:
        raise kind.error("invalid_url", f"file:// {kind.name} URL must hold an absolute path")
    return path


def read_regular_file(path: str, kind: MediaBytes) -> bytes:
    """Read at most kind.max_bytes + 1 bytes of a regular file.

    O_NONBLOCK so a FIFO cannot block the open; O_NOFOLLOW so a symlink swapped in after the containment
    check is not followed; devices, FIFOs and directories are refused by fstat before reading.
    """
    k, max_bytes = kind.name, kind.max_bytes
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise kind.error("failed", f"{k} file not found") from exc
    except OSError as exc:
        raise kind.error("failed", f"{k} file cannot be read") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise kind.error("failed", f"{k} file URL does not name a regular file")
        if info.st_size > max_bytes:
            raise kind.error("too_large", f"{k} is larger than {max_bytes} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # the file grew after fstat
        raise kind.error("too_large", f"{k} is larger than {max_bytes} bytes")
    return data


_Config = TypeVar("_Config")


def fleet_config(identity: dict[str, Any] | None, key: str, parse: Callable[[dict[str, Any]], _Config]) -> _Config | None:
    """A media kind's config from the fleet's model identity (`key`: "video", "audio"): None when absent, null, or
    not such a config (the model is taken to accept none of that kind)."""
    raw = identity.get(key) if identity else None
    return None if raw is None else _parsed_config(key, json.dumps(raw, sort_keys=True), parse)


@functools.lru_cache(maxsize=16)
def _parsed_config(key: str, raw: str, parse: Callable[[dict[str, Any]], _Config]) -> _Config | None:
    """Parsed once per distinct config (the fleet has one), so a bad one is logged once, not per request."""
    try:
        return parse(json.loads(raw))
    except ValueError as exc:
        logger.warning("the fleet's model_identity.%s is not a %s config (%s): refused", key, key, exc)
        return None
