"""Why a gather returned no embeddings for some items."""
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
