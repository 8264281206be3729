"""Decoding untrusted image bytes into RGB pictures, with limits checked before the pixels are read."""
from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 40_000_000  # ~6300x6300; above this the header alone is enough to refuse
ALLOWED_FORMATS = frozenset({"PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"})


class ImageError(ValueError):
    """The bytes are not an image we accept; the message says why."""


def open_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Open and check the header (format, size) without decoding the pixels."""
    if not data:
        raise ImageError("image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we apply our own limit below
            img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ImageError(f"cannot identify image data: {exc}") from exc
    if img.format not in ALLOWED_FORMATS:
        raise ImageError(f"unsupported image format {img.format!r}; allowed: {sorted(ALLOWED_FORMATS)}")
    width, height = img.size
    if width < 1 or height < 1 or width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} pixels; the limit is {max_pixels} pixels")
    return img


def load_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode to RGB (palette, alpha, CMYK, 16-bit are converted)."""
    img = open_image(data, max_pixels)
    try:
        img.load()
        if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
            img = img.convert("RGBA")
            background = Image.new("RGBA", img.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, img).convert("RGB")
        if img.mode.startswith("I"):  # 16/32-bit grey: keep the top 8 of 16 bits
            grey = np.clip(np.asarray(img).astype(np.int64) >> 8, 0, 255).astype(np.uint8)
            return Image.fromarray(grey).convert("RGB")
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"corrupt image data: {exc}") from exc
