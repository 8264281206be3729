"""The fleet simulator's world (epd_bench/fleet_sim.py): encoders with an LRU cache and a queue, proxies each with the
real `Scheduler` and the real bounded `HintIndex` fed by the encoders' stored / evicted events, and a clock. No
sockets and no threads: an encode call is a completion at a simulated time.

An encoder serves its items one after another (FIFO, one at a time: batching is left out, it changes the service
time, not where items go). An item the encoder already holds is answered from its cache at once; an item the hint
index points at but the encoder evicted meanwhile is found missing at gather time and re-encoded (the proxy's
recovery: `schedule(skip_cached=False)`), as in the real stack.
"""
from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from connector.control.hint_index import INDEX_CAPACITY, HintIndex, ProducerView
from scheduler.scheduler import EncoderSlot, MMItem, Scheduler, SchedulerOutput


@dataclass
class SimEncoder:
    name: str
    capacity: int  # items its cache holds (LRU)
    cache: OrderedDict[str, None] = field(default_factory=OrderedDict)
    busy_until: float = 0.0
    outstanding: int = 0  # items queued or being encoded, from every proxy: its true load
    encoded: int = 0

    @property
    def address(self) -> str:
        return f"tcp://{self.name}"

    def store(self, mm_hash: str) -> list[str]:
        """Keep an encoded item; returns those evicted to make room."""
        self.cache[mm_hash] = None
        self.cache.move_to_end(mm_hash)
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        return evicted


class SimProxy:
    """One proxy: its own scheduler (its own outstanding counts) and its own bounded hint index."""

    def __init__(self, encoders: list[SimEncoder], index_capacity: int = INDEX_CAPACITY):
        self.hint = HintIndex(index_capacity)
        for enc in encoders:
            view = ProducerView(enc.address, "")
            self.hint.add(view)
            view.synced = True
        self.scheduler = Scheduler([EncoderSlot(e.name, e.address, _NoCache()) for e in encoders], index=self.hint)

    def stored(self, enc: SimEncoder, stored: list[str], evicted: list[str]) -> None:
        view = self.hint.views[enc.address]
        view.stored(stored)
        view.evicted(evicted)


class _NoCache:
    """Per-encoder views are never asked: the scheduler asks the fleet-wide hint index."""

    def has_cache_item(self, mm_hash: str) -> bool:
        return False


@dataclass
class Counts:
    items: int = 0  # image items requested
    hits: int = 0  # found cached (index hint, or at the encoder it was sent to) or joined to an encode in flight
    encoded: int = 0  # new encodes
    stale: int = 0  # the hint named a holder that had evicted it: re-encoded


class Fleet:
    """Encoders and proxies on one clock; `request` places one request's items, `advance` completes encodes."""

    def __init__(self, num_encoders: int, num_proxies: int, cache_items: int, index_capacity: int = INDEX_CAPACITY,
                 seed: int = 0):
        self.encoders = {f"e{i}": SimEncoder(f"e{i}", cache_items) for i in range(num_encoders)}
        self.by_address = {e.address: e for e in self.encoders.values()}
        self.proxies = [SimProxy(list(self.encoders.values()), index_capacity) for _ in range(num_proxies)]
        self.now, self.counts, self.rng = 0.0, Counts(), random.Random(seed)
        self._done: list[tuple[float, int, str, int, str, bool]] = []  # (time, tie, encoder, proxy, hash, encoded)
        self._tie = 0

    def request(self, hashes: list[str], service_s: list[float]) -> None:
        """One request's images, through a random proxy; `service_s`: each one's encode time if it is encoded."""
        p = self.rng.randrange(len(self.proxies))
        sched = self.proxies[p].scheduler
        items = [MMItem(h, b"") for h in hashes]
        cost = dict(zip(hashes, service_s, strict=True))
        out = sched.schedule(items)
        self.counts.items += len(set(hashes))
        self.counts.hits += len(out.joined)
        stale = [it for it in items if it.mm_hash in out.skipped
                 and it.mm_hash not in self.by_address[out.sources[it.mm_hash]].cache]
        for h in out.skipped:
            enc = self.by_address[out.sources[h]]
            if h in enc.cache:
                enc.cache.move_to_end(h)
                self.counts.hits += 1
        self._run(p, out, cost)
        if stale:  # missing at gather: the proxy re-encodes them, wherever their holder was
            self.counts.stale += len(stale)
            self._run(p, sched.schedule(stale, skip_cached=False), cost)

    def _run(self, p: int, out: SchedulerOutput, cost: dict[str, float]) -> None:
        for name, todo in out.scheduled_encoder_inputs.items():
            enc = self.encoders[name]
            for it in todo:
                if it.mm_hash in enc.cache:  # its home still holds it: answered from the cache
                    enc.cache.move_to_end(it.mm_hash)
                    self.counts.hits += 1
                    self._complete(self.now, name, p, it.mm_hash, False)
                    continue
                enc.outstanding += 1
                enc.busy_until = max(self.now, enc.busy_until) + cost[it.mm_hash]
                self.counts.encoded += 1
                self._complete(enc.busy_until, name, p, it.mm_hash, True)

    def _complete(self, at: float, name: str, p: int, mm_hash: str, encoded: bool) -> None:
        self._tie += 1
        heapq.heappush(self._done, (at, self._tie, name, p, mm_hash, encoded))

    def advance(self, to: float) -> None:
        """Finish every encode due by `to`: stored on its encoder, events to every proxy's index, the proxy told."""
        while self._done and self._done[0][0] <= to:
            at, _, name, p, h, encoded = heapq.heappop(self._done)
            self.now = at
            enc = self.encoders[name]
            if encoded:  # not a cache answer
                enc.outstanding -= 1
                enc.encoded += 1
                evicted = enc.store(h)
                for proxy in self.proxies:
                    proxy.stored(enc, [h], evicted)
            self.proxies[p].scheduler.update_from_output(name, [h], enc.address)
        self.now = to

    def loads(self) -> list[int]:
        return [e.outstanding for e in self.encoders.values()]
