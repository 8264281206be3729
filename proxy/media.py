"""Image references in a request -> checked image bytes (data: URLs in this version)."""
from __future__ import annotations

import base64
import binascii
import re

from common.errors import bad_request
from models.images import ImageError, open_image

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)


def decode_data_url(url: str, param: str, max_bytes: int) -> bytes:
    """data:[<mime>][;base64],<payload> -> bytes, refusing what is malformed or too large."""
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise bad_request("image_url must be a base64 data URL (data:image/<fmt>;base64,...)", param,
                          code="invalid_image_url")
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise bad_request(f"data URL media type {mime!r} is not an image", param, code="invalid_image_url")
    payload = url[m.end():]
    if len(payload) * 3 // 4 > max_bytes:
        raise bad_request(f"image is larger than {max_bytes} bytes", param, code="image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"image data URL is not valid base64: {exc}", param, code="invalid_image_url") from exc


def load_image_bytes(url: str, param: str, max_bytes: int, max_pixels: int) -> bytes:
    """Fetch an image_url's bytes and check they are an image we accept (header only, no decode)."""
    if url.startswith("data:"):
        data = decode_data_url(url, param, max_bytes)
    elif url.startswith(("http://", "https://", "file:")):
        raise bad_request("only data: URLs are supported for image_url in this version", param,
                          code="unsupported_image_url")
    else:
        raise bad_request("image_url.url must be a data: URL", param, code="invalid_image_url")
    try:
        open_image(data, max_pixels)
    except ImageError as exc:
        raise bad_request(str(exc), param, code="invalid_image") from exc
    return data
