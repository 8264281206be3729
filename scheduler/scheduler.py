"""The shared scheduler: skip what is cached anywhere, join what is being encoded, spread the rest by load."""
from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass, field

from scheduler.cache_index import CacheView, holds


@dataclass(frozen=True)
class MMItem:
    mm_hash: str
    data: bytes  # image file bytes


@dataclass
class EncoderSlot:
    """One encoder as the scheduler sees it: where its embeddings live, what it holds, whether it is up."""

    name: str  # e.g. its HTTP URL
    ec_address: str  # ZeroMQ address a decoder gathers from
    cache: CacheView
    healthy: bool = True


class NoEncoderAvailable(RuntimeError):
    """Every encoder is unhealthy, excluded, or there are none."""


@dataclass
class SchedulerOutput:
    sources: dict[str, str] = field(default_factory=dict)  # mm_hash -> ec_address holding (or getting) it
    skipped: list[str] = field(default_factory=list)  # mm_hashes already cached: not encoded again
    # mm_hash -> encoder name already encoding it for another request: wait for that, do not encode again
    joined: dict[str, str] = field(default_factory=dict)
    # encoder name -> items it must encode (one call each, the calls run in parallel)
    scheduled_encoder_inputs: dict[str, list[MMItem]] = field(default_factory=dict)

    @property
    def num_scheduled(self) -> int:
        return sum(len(v) for v in self.scheduled_encoder_inputs.values())


class Scheduler:
    """Routing rules, in order, for each distinct item of a request:

    1. held by a healthy encoder (the fleet cache index says so) -> skipped, gathered from there;
    2. being encoded right now by a healthy encoder -> joined: the request waits for that encode;
    3. otherwise -> the healthy encoder with the least outstanding items (ties: the earliest added),
       counting the items this call already placed, so a request's images are split across encoders.
    """

    def __init__(self, encoders: Collection[EncoderSlot] = ()):
        self.encoders: dict[str, EncoderSlot] = {}
        self.outstanding: dict[str, int] = {}  # encoder name -> items sent, not yet finished
        self.in_flight: dict[str, str] = {}  # mm_hash -> encoder name encoding it now
        self._lock = threading.Lock()
        for slot in encoders:
            self.add(slot)

    # membership and health

    def add(self, slot: EncoderSlot) -> None:
        """Add an encoder, or replace the one of that name (e.g. it restarted on a new address)."""
        with self._lock:
            self.encoders[slot.name] = slot
            self.outstanding.setdefault(slot.name, 0)

    def remove(self, name: str) -> None:
        with self._lock:
            self.encoders.pop(name, None)
            self.outstanding.pop(name, None)
            self._drop_in_flight(name)

    def set_healthy(self, name: str, healthy: bool) -> None:
        """An unhealthy encoder gets no new items and its cache no longer counts; its in-flight items are
        forgotten, so the next request for them is scheduled elsewhere."""
        with self._lock:
            slot = self.encoders.get(name)
            if slot is not None:
                slot.healthy = healthy
                if not healthy:
                    self._drop_in_flight(name)

    def healthy_names(self) -> list[str]:
        with self._lock:
            return [n for n, s in self.encoders.items() if s.healthy]

    # scheduling

    def has_cache_item(self, mm_hash: str) -> bool:
        return any(s.healthy and s.cache.has_cache_item(mm_hash) for s in list(self.encoders.values()))

    def schedule(self, items: list[MMItem], skip_cached: bool = True,
                 exclude: Collection[str] = ()) -> SchedulerOutput:
        """Apply the routing rules to the distinct items; raises NoEncoderAvailable if some item has nowhere to go.

        skip_cached=False ignores rule 1 (recovery: a gather found the item nowhere). `exclude` names
        encoders that already failed these items.
        """
        out = SchedulerOutput()
        unique = list({it.mm_hash: it for it in items}.values())
        with self._lock:
            candidates = [s for s in self.encoders.values() if s.healthy and s.name not in exclude]
        pending = self._skip_cached(unique, candidates, out) if skip_cached else unique
        if not pending:
            return out
        with self._lock:
            names = [s.name for s in candidates if s.name in self.encoders]
            for item in pending:
                owner = self.in_flight.get(item.mm_hash)
                if owner is not None and owner in names:
                    out.joined[item.mm_hash] = owner
                    out.sources[item.mm_hash] = self.encoders[owner].ec_address
                    continue
                if not names:
                    raise NoEncoderAvailable("no healthy encoder is available")
                name = min(names, key=lambda n: self.outstanding[n])  # stable: ties go to the earliest added
                self.outstanding[name] += 1
                self.in_flight[item.mm_hash] = name
                out.scheduled_encoder_inputs.setdefault(name, []).append(item)
                out.sources[item.mm_hash] = self.encoders[name].ec_address
        return out

    def update_from_output(self, name: str, mm_hashes: list[str]) -> None:
        """An encode call returned (or failed): its items are no longer outstanding or in flight there."""
        with self._lock:
            if name in self.outstanding:
                self.outstanding[name] = max(0, self.outstanding[name] - len(mm_hashes))
            for h in mm_hashes:
                if self.in_flight.get(h) == name:
                    del self.in_flight[h]

    def _drop_in_flight(self, name: str) -> None:
        for h in [h for h, owner in self.in_flight.items() if owner == name]:
            del self.in_flight[h]

    @staticmethod
    def _skip_cached(items: list[MMItem], candidates: list[EncoderSlot], out: SchedulerOutput) -> list[MMItem]:
        pending = list(items)
        for enc in candidates:
            if not pending:
                break
            held = holds(enc.cache, [it.mm_hash for it in pending])
            for it, h in zip(pending, held, strict=True):
                if h:
                    out.sources[it.mm_hash] = enc.ec_address
                    out.skipped.append(it.mm_hash)
            pending = [it for it, h in zip(pending, held, strict=True) if not h]
        return pending
