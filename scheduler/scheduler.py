"""The shared scheduler: skip what is cached anywhere, join what is being encoded, place the rest by rendezvous.

It is the one owner of the encodes in flight: each one has a future (the ZeroMQ address holding the item once
stored, or the error), every request for the item waits on that future, and failover moves the encode to another
encoder with the same future.
"""
from __future__ import annotations

import threading
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field

from epd_contracts.audio import AudioPart
from epd_contracts.generate import Detail
from epd_contracts.video import VideoPart
from scheduler.cache_view import CacheView, HolderIndex, holds
from scheduler.rendezvous import RingCache, place


@dataclass(frozen=True)
class MMItem:
    mm_hash: str
    data: bytes  # image file bytes
    detail: Detail = "auto"  # image_url.detail: "low" is encoded at the minimum resolution (and hashed apart)
    multi_image: bool = False  # one of several images of its prompt, for a family where that matters (hashed apart)
    video: VideoPart | None = None  # a video chunk: `data` is the video file, this its frames (epd_contracts/video)
    audio: AudioPart | None = None  # an audio clip or chunk: `data` is the audio file, this its windows
    lora: str = ""  # an image encoded under this adapter's vision-tower weights (mm_hash: hashing.adapter_hash)


@dataclass
class EncoderSlot:
    """One encoder as the scheduler sees it: where its embeddings live, what it holds, whether it is up."""

    name: str  # e.g. its HTTP URL
    ec_address: str  # ZeroMQ address a decoder gathers from
    cache: CacheView
    healthy: bool = True


@dataclass(frozen=True)
class Encode:
    """One item's encode in flight. `result` is a concurrent future: it can be made and resolved with no event loop."""

    encoder: str  # name of the encoder doing it now
    result: Future[str] = field(default_factory=Future)  # ZeroMQ address holding the item once stored


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
    waits: dict[str, Future[str]] = field(default_factory=dict)  # mm_hash -> its encode's result (scheduled, joined)

    @property
    def num_scheduled(self) -> int:
        return sum(len(v) for v in self.scheduled_encoder_inputs.values())

    @property
    def pending(self) -> frozenset[str]:
        """Items still being encoded (by this request or another one)."""
        return frozenset(self.waits)


class Scheduler:
    """Routing rules, in order, for each distinct item of a request:

    1. held by a healthy encoder (the fleet cache index says so) -> skipped, gathered from there;
    2. being encoded right now by a healthy encoder -> joined: the request waits for that encode;
    3. otherwise -> the item's rendezvous home among the healthy encoders (scheduler/rendezvous.py): the encoder
       ranked first for its mm_hash, unless that one has `load_bound` outstanding items or more (counting the items
       this call already placed), then the next in the item's ranking. Every proxy places an image on the same
       encoder, so an item the event index no longer lists (it keeps only recent ones) is still found where it was
       encoded: that encoder answers it from its cache without encoding it again.

    An encode in flight on an encoder that is down or excluded is not joined: rule 1 or 3 takes it over,
    keeping its future, so the requests already waiting for it get the new answer.
    """

    def __init__(self, encoders: Collection[EncoderSlot] = (), index: HolderIndex | None = None):
        """`index`: who holds each item, fleet-wide (the proxy's cache index): rule 1 asks it once per item
        instead of asking every encoder's view, which at a thousand encoders is the difference that counts."""
        self.index = index
        self.encoders: dict[str, EncoderSlot] = {}
        self.outstanding: dict[str, int] = {}  # encoder name -> items sent, not yet finished
        self.in_flight: dict[str, Encode] = {}  # mm_hash -> its encode now
        self._rings = RingCache()
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
        """Its encodes in flight stay until their calls fail over, or another request takes them over."""
        with self._lock:
            self.encoders.pop(name, None)
            self.outstanding.pop(name, None)

    def set_healthy(self, name: str, healthy: bool) -> None:
        """An unhealthy encoder gets no new items, its cache no longer counts and its encodes in flight are
        no longer joined: the next request for them takes them over."""
        with self._lock:
            slot = self.encoders.get(name)
            if slot is not None:
                slot.healthy = healthy

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
        if not skip_cached:
            pending = unique
        elif self.index is not None:
            pending = self._skip_indexed(unique, candidates, out)
        else:
            pending = self._skip_cached(unique, candidates, out)
        with self._lock:
            names = [s.name for s in candidates if s.name in self.encoders]
            for h in out.skipped:
                self._take_over_from_cache(h, names, out.sources[h])
            if pending and not names:
                raise NoEncoderAvailable("no healthy encoder is available")
            for item in pending:
                self._place(item, names, out)
        return out

    def update_from_output(self, name: str, mm_hashes: list[str], result: str | BaseException) -> None:
        """An encode call on `name` ended: its items are no longer outstanding there, and those still in flight
        there get `result` (the ZeroMQ address holding them, or the error)."""
        with self._lock:
            self._release(name, len(mm_hashes))
            self._settle(name, mm_hashes, result)

    def take_back(self, name: str, mm_hashes: list[str]) -> list[str]:
        """An encode call on `name` failed and may be retried elsewhere: its items are no longer outstanding
        there. Returns those still in flight there; schedule() without `name` moves them (same future)."""
        with self._lock:
            self._release(name, len(mm_hashes))
            return [h for h in mm_hashes if h in self.in_flight and self.in_flight[h].encoder == name]

    def settle(self, name: str, mm_hashes: list[str], result: str | BaseException) -> None:
        """Items taken back from `name` that found nowhere else to go: those still in flight there get `result`."""
        with self._lock:
            self._settle(name, mm_hashes, result)

    def _place(self, item: MMItem, names: list[str], out: SchedulerOutput) -> None:
        """Rule 2, else rule 3 (lock held)."""
        encode = self.in_flight.get(item.mm_hash)
        if encode is not None and encode.encoder in names:
            out.joined[item.mm_hash] = encode.encoder
        else:
            name = place(self._rings.get(names), item.mm_hash, [self.outstanding[n] for n in names])
            self.outstanding[name] += 1
            encode = self.in_flight[item.mm_hash] = Encode(name, encode.result if encode else Future())
            out.scheduled_encoder_inputs.setdefault(name, []).append(item)
        out.sources[item.mm_hash] = self.encoders[encode.encoder].ec_address
        out.waits[item.mm_hash] = encode.result

    def _take_over_from_cache(self, mm_hash: str, names: list[str], address: str) -> None:
        """A cached item whose encode in flight is on an encoder down or excluded: that encode ends here."""
        encode = self.in_flight.get(mm_hash)
        if encode is not None and encode.encoder not in names:
            self._settle(encode.encoder, [mm_hash], address)

    def _release(self, name: str, num_items: int) -> None:
        if name in self.outstanding:
            self.outstanding[name] = max(0, self.outstanding[name] - num_items)

    def _settle(self, name: str, mm_hashes: list[str], result: str | BaseException) -> None:
        for h in mm_hashes:
            encode = self.in_flight.get(h)
            if encode is None or encode.encoder != name:
                continue  # finished already, or taken over by another encoder
            del self.in_flight[h]
            if isinstance(result, BaseException):
                encode.result.set_exception(result)
            else:
                encode.result.set_result(result)

    def _skip_indexed(self, items: list[MMItem], candidates: list[EncoderSlot], out: SchedulerOutput) -> list[MMItem]:
        """Rule 1 from the fleet-wide index: the first candidate holding each item."""
        assert self.index is not None
        by_address = {s.ec_address: s for s in candidates}
        pending = []
        for it in items:
            holder = next((a for a in self.index.holders(it.mm_hash) if a in by_address), None)
            if holder is None:
                pending.append(it)
            else:
                out.sources[it.mm_hash] = holder
                out.skipped.append(it.mm_hash)
        return pending

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
