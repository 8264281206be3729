"""What the scheduler asks of a cache: whether it holds an item (a producer, a consumer, an index view)."""
from __future__ import annotations

from typing import Protocol


class CacheView(Protocol):
    """Anything that can say whether it holds an embedding (producer, consumer, index view)."""

    def has_cache_item(self, mm_hash: str) -> bool: ...


class HolderIndex(Protocol):
    """Who holds an item, fleet-wide (connector/control/cache_index.py): the producers' addresses."""

    def holders(self, mm_hash: str) -> list[str]: ...


def holds(view: CacheView, mm_hashes: list[str]) -> list[bool]:
    """Batched when the view supports it, one by one otherwise."""
    batched = getattr(view, "has_cache_items", None)
    if batched is not None:
        return list(batched(mm_hashes))
    return [view.has_cache_item(h) for h in mm_hashes]
