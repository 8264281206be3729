"""Rendezvous (highest-random-weight) placement with bounded load: where an item goes, decided by its key alone.

Every member gets a score for a key, a 64-bit mix of the key's hash and the member's; the key's home is the member
with the highest score, then the next highest, and so on (its ranking). Every proxy computes the same ranking from
the same members, so an image is placed on the same encoder by every proxy with no shared index, and a member that
joins or leaves moves only the keys whose home it is (1/n of them), never a key between two other members.

Bounded load (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018): a member whose load
is at `load_bound` or more is passed over for the next one in the key's ranking, so no member takes more than
`LOAD_FACTOR` times the mean plus one.

Scores are computed for all members at once with numpy where it is installed and there are NUMPY_FROM members or
more (about 15 us a key at a thousand members), else in plain Python with the same arithmetic and so the same
answers (3 us a key at 2 members, 50 us at 128, 0.35 ms at a thousand): the proxy image carries no numpy
(tests/test_torch_free.py), so it is imported on first use.
"""
from __future__ import annotations

import hashlib
import importlib
import math
from collections.abc import Sequence
from functools import cache
from typing import Any

LOAD_FACTOR = 1.25  # a member may hold up to this times the mean load (plus the item being placed) before spilling
NUMPY_FROM = 16  # members from which numpy's fixed cost (~9 us a key) beats plain Python's (~0.35 us a member)
_M1, _M2, _MASK = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, (1 << 64) - 1  # splitmix64's finaliser


def key64(key: str) -> int:
    """A key's (or a member name's) 64-bit hash: blake2b, so a crafted key cannot aim at a member's score."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def mix64(x: int) -> int:
    """splitmix64's finaliser on one 64-bit value."""
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


@cache
def _numpy() -> Any:
    """numpy, or None where it is not installed (the proxy image)."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def _mix_array(np: Any, x: Any) -> Any:
    """mix64 elementwise on a uint64 array (numpy's uint64 arithmetic wraps, as the masks do)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


def load_bound(total_load: int, members: int, factor: float = LOAD_FACTOR) -> int:
    """The load a member must be under to take one more item, with `total_load` items already placed on `members`."""
    return max(1, math.ceil(factor * (total_load + 1) / max(1, members)))


class Ring:
    """The members' seeds, for ranking keys among them. Immutable: a membership change is a new Ring (RingCache)."""

    def __init__(self, names: Sequence[str], use_numpy: bool = True):
        self.names = tuple(names)
        self._seeds = [key64(n) for n in self.names]
        self._np = _numpy() if use_numpy and len(self.names) >= NUMPY_FROM else None
        self._array = None if self._np is None else self._np.array(self._seeds, dtype=self._np.uint64)

    def __len__(self) -> int:
        return len(self.names)

    def scores(self, key: str) -> list[int]:
        """Each member's score for `key`, in `names` order."""
        k = key64(key)
        if self._np is None:
            return [mix64(s ^ k) for s in self._seeds]
        return [int(x) for x in _mix_array(self._np, self._array ^ self._np.uint64(k))]

    def home(self, key: str) -> str:
        """The member ranked first for `key` (load not considered)."""
        return self.names[self._best(key)]

    def ranking(self, key: str) -> list[str]:
        """Every member, best first for `key`."""
        return [self.names[i] for i in self._order(key)]

    def pick(self, key: str, loads: Sequence[int], bound: int) -> str:
        """The first member in `key`'s ranking whose load (`loads`, in `names` order) is under `bound`; the least
        loaded one if none is (only when `bound` is below the mean, which load_bound never gives)."""
        best = self._best(key)
        if loads[best] < bound:
            return self.names[best]
        for i in self._order(key):
            if loads[i] < bound:
                return self.names[i]
        return self.names[min(range(len(loads)), key=loads.__getitem__)]

    def _order(self, key: str) -> list[int]:
        scores = self.scores(key)
        return sorted(range(len(scores)), key=scores.__getitem__, reverse=True)

    def _best(self, key: str) -> int:
        """The index of the highest score (the hot path: no list in numpy's case)."""
        if self._np is None:
            k = key64(key)
            scores = [mix64(s ^ k) for s in self._seeds]
            return max(range(len(scores)), key=scores.__getitem__)
        return int(self._np.argmax(_mix_array(self._np, self._array ^ self._np.uint64(key64(key)))))


class RingCache:
    """The Ring of the last few member lists (a ranking is asked for every placement; membership changes rarely)."""

    def __init__(self, size: int = 8):
        self.size = size
        self._rings: dict[tuple[str, ...], Ring] = {}

    def get(self, names: Sequence[str]) -> Ring:
        key = tuple(names)
        ring = self._rings.pop(key, None) or Ring(key)
        self._rings[key] = ring  # most recent last
        while len(self._rings) > self.size:
            del self._rings[next(iter(self._rings))]
        return ring


def place(ring: Ring, key: str, loads: Sequence[int], factor: float = LOAD_FACTOR) -> str:
    """`key`'s member: its home unless that one is at the load bound, then the next in its ranking (see the module)."""
    return ring.pick(key, loads, load_bound(sum(loads), len(ring), factor))
