"""Decoding untrusted image bytes into RGB pictures, with limits checked before the pixels are read."""
from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 40_000_000  # ~6300x6300; above this the header alone is enough to refuse
# MPO is what Pillow calls a JPEG carrying extra frames (many phone cameras write one); it decodes as JPEG.
ALLOWED_FORMATS = frozenset({"PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP", "TIFF"})
# Only these Pillow plugins are ever tried on untrusted bytes, so exotic parsers (EPS via Ghostscript, PSD,
# ICNS, ...) never see them. MPO files are recognised by the JPEG plugin.
_OPEN_WITH = tuple(sorted(ALLOWED_FORMATS - {"MPO"}))


class ImageError(ValueError):
    """The bytes are not an image we accept; the message says why (and is safe to show a client)."""


class ImageTooLargeError(ImageError):
    """The header declares more pixels than the limit; refused before any pixel is decoded."""


def webp_canvas_size(data: bytes) -> tuple[int, int] | None:
    """The canvas size a WebP header declares, or None if `data` is not a WebP header we can read.

    Needed because Pillow's WebP plugin creates libwebp's decoder -- which allocates the whole canvas, twice --
    inside Image.open, before any caller can look at the size; Pillow only guards that with its own, much
    higher, decompression-bomb limit. (Same layouts as Pillow's WebPImagePlugin._get_size.)
    """
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":  # lossy: 14-bit sizes in the key frame header
        return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    if chunk == b"VP8X":  # extended: 24-bit canvas size minus one
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    if chunk == b"VP8L" and data[20] == 0x2F:  # lossless: 14-bit sizes minus one
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"image is {width}x{height} pixels; it must be at least 1x1")
    if width * height > max_pixels:
        raise ImageTooLargeError(f"image is {width}x{height} pixels; the limit is {max_pixels} pixels")


def open_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Open and check the header (format, size) without decoding the pixels.

    Cheap whatever the declared size: Pillow reads only the header here, so a 30000x30000 PNG is refused in
    microseconds with no pixel buffer allocated. Pillow's own decompression-bomb limit (2x
    Image.MAX_IMAGE_PIXELS) still applies above ours and is reported the same way.
    """
    if not data:
        raise ImageError("image is empty")
    if (webp_size := webp_canvas_size(data)) is not None:
        _check_pixels(*webp_size, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we apply our own limit below
            img = Image.open(io.BytesIO(data), formats=_OPEN_WITH)
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"image has too many pixels; the limit is {max_pixels} pixels") from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"cannot identify image data; supported formats: {', '.join(sorted(ALLOWED_FORMATS))}"
                         ) from exc
    if img.format not in ALLOWED_FORMATS:  # defensive: a plugin may report a format we did not ask for
        raise ImageError(f"unsupported image format {img.format!r}; allowed: {sorted(ALLOWED_FORMATS)}")
    _check_pixels(*img.size, max_pixels)
    return img


def load_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode to RGB (palette, alpha, CMYK, 16-bit are converted; transparency is composited on white)."""
    img = open_image(data, max_pixels)
    try:
        img.load()
        if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
            img = img.convert("RGBA")
            background = Image.new("RGBA", img.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, img).convert("RGB")
        if img.mode.startswith("I"):  # 16/32-bit grey: keep the top 8 of 16 bits
            import numpy as np  # here, not above: the proxy (open_image only) runs without numpy

            grey = np.clip(np.asarray(img).astype(np.int64) >> 8, 0, 255).astype(np.uint8)
            return Image.fromarray(grey).convert("RGB")
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"corrupt image data: {exc}") from exc
