"""Media loading in the proxy: URL forms, data: and file:// URLs, and the image checks (bombs, odd modes)."""
from __future__ import annotations

import os
import struct
import tracemalloc
import zlib
from functools import cache
from pathlib import Path

import pytest
from PIL import Image, ImageFile

from epd_common.images import ImageError, ImageTooLargeError, load_image, open_image
from tests.factories import make_image
from tests.proxy.media_helpers import (
    PARAM,
    PNG,
    as_data_url,
    config,
    encode,
    fetched,
    refused,
)

# --- URL forms ----------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("no_connections")
@pytest.mark.parametrize("url", ["ftp://example.com/x.png", "gopher://example.com/", "javascript:alert(1)",
                                 "//example.com/x.png", "x.png", "", "http:///x.png", "http://exa mple.com/"])
def test_other_schemes_and_malformed_urls_are_invalid(url: str) -> None:
    assert refused(config(), url).code == "invalid_image_url"


def test_oversized_data_urls_are_refused_before_decoding() -> None:
    err = refused(config(max_image_bytes=100), as_data_url(PNG))
    assert err.code == "image_too_large"


# --- file:// URLs -------------------------------------------------------------------------------------------

@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    return root


def test_file_urls_under_the_allowed_directory_are_read(media_dir: Path) -> None:
    cfg = config(allowed_local_media_path=str(media_dir))
    assert fetched(cfg, f"file://{media_dir}/sub/cat.png") == PNG
    assert fetched(cfg, f"file://localhost{media_dir}/sub/../sub/cat.png") == PNG
    (media_dir / "alias.png").symlink_to(media_dir / "sub" / "cat.png")  # a link that stays inside is fine
    assert fetched(cfg, f"file://{media_dir}/alias.png") == PNG


def test_the_allowed_directory_may_itself_be_a_symlink(media_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(media_dir)
    assert fetched(config(allowed_local_media_path=str(tmp_path / "link")), f"file://{media_dir}/sub/cat.png") == PNG


def test_file_urls_escaping_the_allowed_directory_are_refused(media_dir: Path, tmp_path: Path) -> None:
    cfg = config(allowed_local_media_path=str(media_dir))
    (media_dir / "escape.png").symlink_to(tmp_path / "secret.png")
    (tmp_path / "media-evil").mkdir()  # a sibling sharing the prefix is not inside
    (tmp_path / "media-evil" / "x.png").write_bytes(PNG)
    for url in [f"file://{media_dir}/../secret.png", f"file://{media_dir}/%2e%2e/secret.png",
                f"file://{media_dir}/escape.png", f"file://{tmp_path}/media-evil/x.png", "file:///etc/passwd"]:
        err = refused(cfg, url)
        assert (err.code, err.param) == ("image_url_forbidden", PARAM), url


@pytest.mark.parametrize("url", ["file:///etc/passwd", "file:///dev/zero", "file://localhost/etc/hostname"])
def test_file_urls_are_refused_when_no_directory_is_allowed(url: str) -> None:
    err = refused(config(), url)
    assert err.code == "image_url_forbidden" and "not enabled" in err.message


def test_unreadable_or_special_files_are_refused_without_blocking(media_dir: Path) -> None:
    cfg = config(allowed_local_media_path=str(media_dir), max_image_bytes=len(PNG))
    os.mkfifo(media_dir / "pipe.png")  # opening a FIFO for reading would block without O_NONBLOCK
    (media_dir / "big.png").write_bytes(PNG + b"\0")
    cases = {"pipe.png": "image_fetch_failed", "sub": "image_fetch_failed", "none.png": "image_fetch_failed",
             "big.png": "image_too_large"}
    for name, code in cases.items():
        assert refused(cfg, f"file://{media_dir}/{name}").code == code, name
    assert refused(cfg, f"file://otherhost{media_dir}/sub/cat.png").code == "invalid_image_url"


# --- image checks -------------------------------------------------------------------------------------------

@cache
def huge_png(side: int = 30_000) -> bytes:
    """A valid side x side 1-bit PNG of zeros: ~100 KB on disk, 900 Mpixels (the IDAT is zlib'd zero rows)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = bytes((1 + (side + 7) // 8) * 1000)  # filter byte + packed bits, 1000 rows
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(rows) for _ in range(side // 1000)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_a_huge_image_is_refused_on_its_header_quickly_and_in_little_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    url = as_data_url(huge_png())
    with monkeypatch.context() as m:  # quickly: refused from the header, not one pixel decoded
        m.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("pixels were decoded"))
        err = refused(config(), url)
    assert err.code == "image_too_large" and "pixels" in err.message
    tracemalloc.start()
    try:
        refused(config(), url)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20
    with pytest.raises(ImageTooLargeError):
        load_image(huge_png())


def webp_header(width: int, height: int) -> bytes:
    """An extended (VP8X) WebP header declaring a width x height canvas: a few dozen bytes."""
    vp8x = b"\0" * 4 + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    body = b"WEBP" + b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_a_webp_canvas_over_the_limit_is_refused_before_libwebp_allocates_it() -> None:
    """Pillow would create libwebp's decoder (a canvas of 4 bytes per pixel, twice) inside Image.open."""
    err = refused(config(), as_data_url(webp_header(13_000, 13_000), "image/webp"))
    assert err.code == "image_too_large" and "13000x13000" in err.message  # our check, not Pillow's
    with pytest.raises(ImageTooLargeError, match="7000x7000"):
        open_image(webp_header(7000, 7000))


def test_the_pixel_limit_is_the_configured_one() -> None:
    err = refused(config(max_image_pixels=32 * 24 - 1), as_data_url(PNG))
    assert err.code == "image_too_large" and "32x24" in err.message
    assert open_image(PNG, 32 * 24).size == (32, 24)


@pytest.mark.parametrize("raw", [
    encode(make_image(16, 16), "ICO"), encode(make_image(16, 16), "TGA"), encode(make_image(16, 16), "PCX"),
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", b"<svg xmlns='http://www.w3.org/2000/svg'/>",
    PNG[:20], b"",
], ids=["ico", "tga", "pcx", "eps", "svg", "truncated_header", "empty"])
def test_unsupported_or_broken_formats_are_refused(raw: bytes) -> None:
    err = refused(config(), as_data_url(raw))
    assert err.code == "invalid_image" and "0x" not in err.message  # no object reprs leak


def _grey16() -> Image.Image:
    img = Image.new("I;16", (20, 10))
    img.putpixel((0, 0), 65535)
    return img


def _palette_with_transparency() -> bytes:
    img = Image.new("P", (12, 8), 1)
    img.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    img.putpixel((0, 0), 0)
    return encode(img, "PNG", transparency=0)


ODD_IMAGES = {
    "cmyk_jpeg": (encode(Image.new("CMYK", (20, 10), (0, 255, 255, 0)), "JPEG"), (20, 10)),
    "grey16_png": (encode(_grey16(), "PNG"), (20, 10)),
    "palette_transparency_png": (_palette_with_transparency(), (12, 8)),
    "rgba_png": (encode(Image.new("RGBA", (9, 7), (255, 0, 0, 0)), "PNG"), (9, 7)),
    "la_png": (encode(Image.new("LA", (5, 5), (10, 128)), "PNG"), (5, 5)),
    "one_by_one": (encode(Image.new("RGB", (1, 1), "blue"), "PNG"), (1, 1)),
    "very_wide": (encode(Image.new("L", (4000, 2), 200), "PNG"), (4000, 2)),
    "bilevel_tiff": (encode(Image.new("1", (30, 3), 1), "TIFF"), (30, 3)),
    "animated_gif": (encode(Image.new("P", (6, 6)), "GIF", save_all=True,
                            append_images=[Image.new("P", (6, 6), 3)]), (6, 6)),
    "webp": (encode(Image.new("RGB", (8, 8), "green"), "WEBP"), (8, 8)),
    "bmp": (encode(Image.new("RGB", (3, 5), "green"), "BMP"), (3, 5)),
    "lossless_webp": (encode(Image.new("RGBA", (7, 4), (0, 0, 255, 128)), "WEBP", lossless=True), (7, 4)),
    "mpo": (encode(Image.new("RGB", (8, 6), "red"), "MPO", save_all=True,
                   append_images=[Image.new("RGB", (8, 6), "blue")]), (8, 6)),  # JPEG with extra frames
}


@pytest.mark.parametrize("name", list(ODD_IMAGES))
def test_odd_but_valid_images_are_accepted_and_decode_to_rgb(name: str) -> None:
    raw, size = ODD_IMAGES[name]
    assert fetched(config(), as_data_url(raw, "image/x-any")) == raw
    img = load_image(raw)
    assert (img.mode, img.size) == ("RGB", size)


def test_conversions_keep_the_picture() -> None:
    rgba = load_image(ODD_IMAGES["rgba_png"][0])
    assert rgba.getpixel((0, 0)) == (255, 255, 255)  # fully transparent red composites to white
    palette = load_image(ODD_IMAGES["palette_transparency_png"][0])
    assert palette.getpixel((0, 0)) == (255, 255, 255) and palette.getpixel((1, 1)) == (255, 0, 0)
    grey = load_image(ODD_IMAGES["grey16_png"][0])
    assert grey.getpixel((0, 0)) == (255, 255, 255) and grey.getpixel((1, 0)) == (0, 0, 0)
    cmyk = load_image(ODD_IMAGES["cmyk_jpeg"][0]).getpixel((5, 5))
    assert isinstance(cmyk, tuple) and cmyk[0] > 200 and cmyk[1] < 60 and cmyk[2] < 60  # red


def test_corrupt_pixels_are_an_image_error() -> None:
    with pytest.raises(ImageError):
        load_image(PNG[: len(PNG) // 2])
