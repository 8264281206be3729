"""What a media file's bytes are loaded as (its kind's name and byte cap), and the error a refused one becomes."""
from __future__ import annotations

from dataclasses import dataclass

# a reason a media reference is refused -> its error code, by the media kind's name
_CODES = {"invalid_url": "invalid_{}_url", "forbidden": "{}_url_forbidden", "failed": "{}_fetch_failed",
          "too_large": "{}_too_large", "invalid": "invalid_{}", "timeout": "{}_fetch_timeout"}


class MediaError(Exception):
    """A media reference we refuse; proxy.media turns it into an error (400 unless `status` says otherwise)
    naming the request field."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass(frozen=True)
class MediaBytes:
    """What a URL is loaded as: its kind's name (in messages and error codes: image_too_large, invalid_video_url,
    ...), the byte cap of one file, and the media types taken from a server or a data: URL (``<name>/*``)."""

    name: str  # "image", "video" or "audio"
    max_bytes: int

    @property
    def accept(self) -> str:
        return f"{self.name}/*"

    def error(self, reason: str, message: str, status: int = 400) -> MediaError:
        """The MediaError for `reason` (a key of _CODES): e.g. "too_large" -> code video_too_large."""
        return MediaError(_CODES[reason].format(self.name), message, status)
