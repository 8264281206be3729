"""Why a gather returned no embeddings for some items, or a K/V fetch no blocks."""
from __future__ import annotations


class MissingEmbeddings(Exception):
    """Raised when some embeddings are neither cached locally nor found at their producer."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = list(missing)
        # NOTE: args holds the list (not the message) so the exception survives a process boundary.
        super().__init__(self.missing)

    def __str__(self) -> str:
        return f"missing embeddings for {len(self.missing)} item(s): {', '.join(self.missing)}"


class InvalidEmbeddings(Exception):
    """Raised when received embeddings fail the consumer's check against its own model (dtype, width, token count);
    they were not cached."""

    def __init__(self, reasons: dict[str, str]) -> None:
        self.reasons = dict(reasons)  # mm_hash -> why it was refused
        super().__init__(self.reasons)

    def __str__(self) -> str:
        return "embeddings refused: " + "; ".join(f"{h}: {why}" for h, why in self.reasons.items())


class KVUnavailable(Exception):
    """Raised when a K/V hand-off cannot be had from its producer (gone, refused, timed out, or failing the
    consumer's checks); nothing was built, and the decode worker recomputes the prefill."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)  # args holds the reason, so the exception survives a process boundary

    def __str__(self) -> str:
        return f"K/V unavailable: {self.reason}"
