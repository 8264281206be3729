"""Which embeddings the fleet already holds: the answer behind has_cache_item."""
from __future__ import annotations

from typing import Protocol

from connector import ECConsumer


class CacheView(Protocol):
    """Anything that can say whether it holds an embedding (producer, consumer, remote encoder)."""

    def has_cache_item(self, mm_hash: str) -> bool: ...


class RemoteEncoderCache:
    """An encoder's producer cache, asked over ZeroMQ (batched `has` query)."""

    def __init__(self, consumer: ECConsumer, address: str, timeout: float = 2.0):
        self.consumer, self.address, self.timeout = consumer, address, timeout

    def has_cache_item(self, mm_hash: str) -> bool:
        return self.has_cache_items([mm_hash])[0]

    def has_cache_items(self, mm_hashes: list[str]) -> list[bool]:
        return self.consumer.query(self.address, mm_hashes, self.timeout)


def holds(view: CacheView, mm_hashes: list[str]) -> list[bool]:
    """Batched when the view supports it, one by one otherwise."""
    batched = getattr(view, "has_cache_items", None)
    if batched is not None:
        return list(batched(mm_hashes))
    return [view.has_cache_item(h) for h in mm_hashes]
