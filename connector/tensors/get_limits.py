"""The producer's default bounds on one get and its reply (torch-free, so the encoder's flags can show them)."""
from __future__ import annotations

MAX_ITEMS_PER_GET = 256  # hashes one get or has may ask for; more get an error reply
MAX_REPLY_BYTES = 256 << 20  # tensor bytes of one get reply (besides its first item); the rest are sent as `more`
