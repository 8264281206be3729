"""Gets a producer holds back until the items they wait for are stored, fail, or time out."""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

MAX_PARKED = 4096  # gets waiting at once; more are answered at once with what is there
MAX_PARKED_HASHES = 1 << 16  # hashes all parked gets hold together (each at most MAX_HASH_LEN characters)
MAX_FAILED = 4096  # recently failed hashes remembered, so a get arriving late still fails fast


@dataclass(eq=False)
class ParkedGet:
    identity: bytes  # ROUTER routing id of the consumer
    req_id: int
    hashes: list[str]
    wait: set[str]  # the hashes not stored yet when it arrived
    deadline: float  # time.monotonic() at which it is answered regardless
    shm: bool = False  # the consumer maps shared memory: answer held items by handle
    done: bool = field(default=False)


class WaitList:
    """Parked gets, indexed by the hashes they wait for and by deadline; used by one thread."""

    def __init__(self, max_parked: int = MAX_PARKED, max_hashes: int = MAX_PARKED_HASHES) -> None:
        self.max_parked, self.max_hashes = max_parked, max_hashes
        self._by_hash: dict[str, list[ParkedGet]] = {}
        self._deadlines: list[tuple[float, int, ParkedGet]] = []  # heap
        self._order = itertools.count()
        self._num_parked = 0
        self._num_hashes = 0  # hashes the parked gets hold (their `hashes` lists)

    def __len__(self) -> int:
        return self._num_parked

    @property
    def num_hashes(self) -> int:
        return self._num_hashes

    @property
    def is_full(self) -> bool:
        return self._num_parked >= self.max_parked

    def can_park(self, num_hashes: int) -> bool:
        """Whether a get holding `num_hashes` hashes fits under both caps."""
        return self._num_parked < self.max_parked and self._num_hashes + num_hashes <= self.max_hashes

    def park(self, get: ParkedGet) -> None:
        assert get.wait and self.can_park(len(get.hashes)), "park only a get that waits for something, under the caps"
        self._num_hashes += len(get.hashes)
        for mm_hash in get.wait:
            self._by_hash.setdefault(mm_hash, []).append(get)
        heapq.heappush(self._deadlines, (get.deadline, next(self._order), get))
        self._num_parked += 1

    def resolve(self, mm_hashes: Iterable[str], settled: Callable[[str], bool]) -> list[ParkedGet]:
        """Gets that `mm_hashes` (just stored or failed) may have completed: all their waits settled."""
        ready: list[ParkedGet] = []
        for mm_hash in dict.fromkeys(mm_hashes):
            for get in self._by_hash.pop(mm_hash, []):
                if not get.done and all(settled(h) for h in get.wait):
                    ready.append(self._finish(get))
                elif not get.done:
                    self._by_hash.setdefault(mm_hash, []).append(get)  # still waiting on others
        return ready

    def expired(self, now: float) -> list[ParkedGet]:
        """Gets whose deadline has passed, oldest first."""
        out: list[ParkedGet] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            get = heapq.heappop(self._deadlines)[2]
            if not get.done:
                out.append(self._finish(get))
        return out

    def next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _finish(self, get: ParkedGet) -> ParkedGet:
        get.done = True
        self._num_parked -= 1
        self._num_hashes -= len(get.hashes)
        for mm_hash in get.wait:
            waiting = self._by_hash.get(mm_hash)
            if waiting is not None and get in waiting:
                waiting.remove(get)
                if not waiting:
                    del self._by_hash[mm_hash]
        return get


class FailedSet:
    """A bounded, insertion-ordered set of hashes whose encoding failed recently."""

    def __init__(self, capacity: int = MAX_FAILED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, None] = OrderedDict()

    def add(self, mm_hash: str) -> None:
        self._items[mm_hash] = None
        self._items.move_to_end(mm_hash)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def discard(self, mm_hash: str) -> None:
        self._items.pop(mm_hash, None)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._items

    def frozen(self, among: Iterable[str]) -> frozenset[str]:
        if not self._items:
            return frozenset()
        return frozenset(h for h in among if h in self._items)
