"""The shared scheduler: skip what is cached anywhere, spread the rest over encoders by load."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from scheduler.cache_index import CacheView, holds


@dataclass(frozen=True)
class MMItem:
    mm_hash: str
    data: bytes  # image file bytes


@dataclass(frozen=True)
class EncoderSlot:
    """One encoder as the scheduler sees it: where its embeddings live and what it holds."""

    name: str  # e.g. its HTTP URL
    ec_address: str  # ZeroMQ address a decoder gathers from
    cache: CacheView


@dataclass
class SchedulerOutput:
    sources: dict[str, str] = field(default_factory=dict)  # mm_hash -> ec_address holding (or getting) it
    skipped: list[str] = field(default_factory=list)  # mm_hashes already cached: not encoded again
    # encoder index -> items it must encode
    scheduled_encoder_inputs: dict[int, list[MMItem]] = field(default_factory=dict)

    @property
    def num_scheduled(self) -> int:
        return sum(len(v) for v in self.scheduled_encoder_inputs.values())


class Scheduler:
    def __init__(self, encoders: list[EncoderSlot]):
        assert encoders, "the scheduler needs at least one encoder"
        self.encoders = encoders
        self.outstanding = [0] * len(encoders)  # encoder index -> items sent, not yet finished
        self._lock = threading.Lock()

    def has_cache_item(self, mm_hash: str) -> bool:
        return any(view.cache.has_cache_item(mm_hash) for view in self.encoders)

    def schedule(self, items: list[MMItem], skip_cached: bool = True) -> SchedulerOutput:
        """Skip items some encoder holds; assign each remaining unique item to the least-loaded encoder.

        skip_cached=False re-encodes everything (recovery after a gather found an item nowhere).
        """
        out = SchedulerOutput()
        unique = list({it.mm_hash: it for it in items}.values())
        pending = self._skip_cached(unique, out) if skip_cached else unique
        with self._lock:
            load = list(self.outstanding)
            for item in pending:
                idx = min(range(len(load)), key=lambda i: (load[i], i))
                load[idx] += 1
                self.outstanding[idx] += 1
                out.scheduled_encoder_inputs.setdefault(idx, []).append(item)
                out.sources[item.mm_hash] = self.encoders[idx].ec_address
        return out

    def update_from_output(self, encoder_index: int, num_finished: int) -> None:
        """An encode call returned (or failed): its items no longer count as outstanding."""
        with self._lock:
            self.outstanding[encoder_index] = max(0, self.outstanding[encoder_index] - num_finished)

    def _skip_cached(self, items: list[MMItem], out: SchedulerOutput) -> list[MMItem]:
        pending = list(items)
        for enc in self.encoders:
            if not pending:
                break
            held = holds(enc.cache, [it.mm_hash for it in pending])
            for it, h in zip(pending, held, strict=True):
                if h:
                    out.sources[it.mm_hash] = enc.ec_address
                    out.skipped.append(it.mm_hash)
            pending = [it for it, h in zip(pending, held, strict=True) if not h]
        return pending
