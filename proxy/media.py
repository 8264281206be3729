"""Image references in a request -> checked image bytes.

An image_url may be:

* a ``data:`` URL (base64 payload);
* an ``http(s)://`` URL, fetched with an SSRF guard (``proxy/fetch.py``);
* a ``file://`` URL, only when ``ProxyConfig.allowed_local_media_path`` is set and the real path (symlinks
  and ``..`` resolved) lies under it.

Whatever the source, the bytes are capped at ``max_image_bytes`` while they are read (never read unbounded)
and must pass the header-only check of ``epd_common.images.open_image`` (format allow-list, pixel limit).
Error messages name the problem and at most the URL's host; resolved addresses and OS errors are not shown.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from urllib.parse import unquote, urlsplit

from epd_common.errors import APIError, bad_request
from epd_common.images import ImageError, ImageTooLargeError, open_image
from proxy.config import ProxyConfig
from proxy.fetch import MediaError, fetch_http_image
from proxy.protocol import ChatCompletionRequest, ImagePart

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)


def load_image_bytes(url: str, param: str, cfg: ProxyConfig, deadline: float | None = None) -> bytes:
    """An image_url's bytes, fetched under cfg's media rules and checked to be an image we accept.

    `deadline` (time.monotonic()) is when all of the request's images must be loaded. Raises APIError 400 with
    `param` and one of the codes: invalid_image_url, image_url_forbidden, image_fetch_failed, image_too_large,
    invalid_image; or 408 image_fetch_timeout when the deadline passes during a download.
    """
    try:
        data = read_image_source(url, cfg, deadline)
        open_image(data, cfg.max_image_pixels)
    except MediaError as exc:
        raise APIError(exc.status, exc.message, param=param, code=exc.code) from exc
    except ImageTooLargeError as exc:
        raise bad_request(str(exc), param, code="image_too_large") from exc
    except ImageError as exc:
        raise bad_request(str(exc), param, code="invalid_image") from exc
    return data


def has_remote_images(req: ChatCompletionRequest) -> bool:
    """Whether any image of the request is an http(s) URL (a download: it needs a fetch slot)."""
    return any(isinstance(p, ImagePart) and p.image_url.url[:8].lower().startswith(("http://", "https://"))
               for m in req.messages if isinstance(m.content, list) for p in m.content)


def read_image_source(url: str, cfg: ProxyConfig, deadline: float | None = None) -> bytes:
    """Dispatch on the URL scheme; anything but data:, http(s): and file: is refused."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_url(url, cfg.max_image_bytes)
    if scheme in ("http", "https"):
        return fetch_http_image(url, cfg, deadline)
    if scheme == "file":
        return read_file_image(url, cfg)
    raise MediaError("invalid_image_url", "image_url.url must be a data:, http(s):// or file:// URL")


# --- data: URLs ---------------------------------------------------------------------------------------------

def decode_data_url(url: str, max_bytes: int) -> bytes:
    """data:[<mime>][;base64],<payload> -> bytes, refusing what is malformed or too large (before decoding)."""
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise MediaError("invalid_image_url", "image data URL must be base64 (data:image/<fmt>;base64,...)")
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise MediaError("invalid_image_url", f"data URL media type {mime!r} is not an image")
    payload = url[m.end():]
    if len(payload) * 3 // 4 > max_bytes:
        raise MediaError("image_too_large", f"image is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError("invalid_image_url", f"image data URL is not valid base64: {exc}") from exc


# --- file:// URLs -------------------------------------------------------------------------------------------

def read_file_image(url: str, cfg: ProxyConfig) -> bytes:
    """A local file, only from under cfg.allowed_local_media_path (checked on the fully resolved path)."""
    if not cfg.allowed_local_media_path:
        raise MediaError("image_url_forbidden", "file:// image URLs are not enabled on this server")
    root = os.path.realpath(cfg.allowed_local_media_path)
    path = os.path.realpath(file_url_path(url))  # symlinks and '..' resolved before the containment check
    if os.path.commonpath([root, path]) != root:
        raise MediaError("image_url_forbidden", "file:// image URL is outside the allowed media directory")
    return read_regular_file(path, cfg.max_image_bytes)


def file_url_path(url: str) -> str:
    """file:///abs/path or file://localhost/abs/path -> /abs/path (percent-decoded); other hosts are refused."""
    parts = urlsplit(url)
    if parts.netloc.lower() not in ("", "localhost"):
        raise MediaError("invalid_image_url", "file:// image URLs must name a local path (file:///path)")
    path = unquote(parts.path)
    if not path.startswith("/") or "\0" in path:
        raise MediaError("invalid_image_url", "file:// image URL must hold an absolute path")
    return path


def read_regular_file(path: str, max_bytes: int) -> bytes:
    """Read at most max_bytes + 1 bytes of a regular file.

    O_NONBLOCK so a FIFO cannot block the open; O_NOFOLLOW so a symlink swapped in after the containment
    check is not followed; devices, FIFOs and directories are refused by fstat before reading.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise MediaError("image_fetch_failed", "image file not found") from exc
    except OSError as exc:
        raise MediaError("image_fetch_failed", "image file cannot be read") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError("image_fetch_failed", "image file URL does not name a regular file")
        if info.st_size > max_bytes:
            raise MediaError("image_too_large", f"image is larger than {max_bytes} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # the file grew after fstat
        raise MediaError("image_too_large", f"image is larger than {max_bytes} bytes")
    return data
