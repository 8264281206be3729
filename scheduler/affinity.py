"""Prefix affinity: send a request to the decoder most likely to hold the K/V of its prompt's longest prefix; on a
miss, to its first key's rendezvous home.

What the proxy believes a decoder holds (HeldPrefixes) is the `prefix_cache.keys` of its last /health, plus the
keys of the requests the proxy sent it that finished after that probe started: a decoder donates a request's K/V
when it finishes, and its /health lags by up to a probe interval. Both are bounded; garbage in /health is ignored.

The rule (choose): among the candidates whose load (generations in flight) is at most the least-loaded one's plus
`load_gap`, the one holding the longest prefix of the request's keys, ties to the least loaded. So a busy decoder
keeps its conversations until it is more than `load_gap` requests busier than the idlest one; then they go where
there is room (re-prefilled there, after which that decoder holds them too).

When no candidate holds any of its keys (a miss), a request goes where the encoders' items go
(scheduler/rendezvous.py): to the rendezvous home of its first key (the conversation's first message, the same in
every turn) among the candidates under the load bound. So every proxy sends a conversation, and every conversation
that opens with the same message, to the same decoder while it has room, with no shared state between proxies.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol, TypeVar

from epd_contracts.generate import MAX_PREFIX_KEY_CHARS
from scheduler.rendezvous import RingCache, place

MAX_REPORTED_KEYS = 4096  # keys taken from one /health (the decoder reports at most this many)
MAX_RECENT_KEYS = 4096  # keys of finished requests kept per decoder until its /health has them (LRU)
Route = Literal["hit", "miss", "overloaded"]  # epd_proxy_affinity_routed_total{result}
ROUTES: tuple[Route, ...] = ("hit", "miss", "overloaded")
_RINGS = RingCache()  # the decoders' (and prefill workers') rings, by member list


class HeldPrefixes:
    """The prefix keys one decoder is believed to hold."""

    def __init__(self) -> None:
        self.reported: frozenset[str] = frozenset()  # its last /health's prefix_cache.keys
        self.recent: OrderedDict[str, int] = OrderedDict()  # key -> finish number, oldest finish first
        self.caching = False  # its /health says it keeps a prefix cache: finished requests' keys count only then
        self._finishes = 0

    def probe_started(self) -> int:
        """A mark for `update`: keys of requests finished before it are in the /health this probe reads."""
        return self._finishes

    def update(self, prefix_cache: object, mark: int) -> None:
        """Replace the reported keys with a /health's `prefix_cache` (none when it is absent, disabled or not of the
        contract's shape); forget the finished requests' keys that this /health already covers."""
        self.caching = isinstance(prefix_cache, dict) and prefix_cache.get("enabled", True) is not False
        keys = prefix_cache.get("keys") if self.caching and isinstance(prefix_cache, dict) else None
        self.reported = frozenset(k for k in keys[:MAX_REPORTED_KEYS] if isinstance(k, str)
                                  and 0 < len(k) <= MAX_PREFIX_KEY_CHARS) if isinstance(keys, list) else frozenset()
        if not self.caching:
            self.recent.clear()
        while self.recent and next(iter(self.recent.values())) <= mark:
            self.recent.popitem(last=False)

    def finished(self, keys: Iterable[str]) -> None:
        """A request with these keys finished on this decoder: it holds their K/V now."""
        if not self.caching:
            return
        self._finishes += 1
        for key in keys:
            self.recent[key] = self._finishes
            self.recent.move_to_end(key)
        while len(self.recent) > MAX_RECENT_KEYS:
            self.recent.popitem(last=False)

    def depth(self, keys: Sequence[str]) -> int:
        """How many messages of the request's prompt it holds: the highest i + 1 with keys[i] held, else 0."""
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in self.reported or keys[i] in self.recent:
                return i + 1
        return 0


class Candidate(Protocol):
    url: str
    load: int  # generations in flight
    prefixes: HeldPrefixes


C = TypeVar("C", bound=Candidate)


def least_loaded(candidates: Sequence[C]) -> C:
    return min(candidates, key=lambda w: w.load)


def _home(candidates: Sequence[C], key: str) -> C:
    """The rendezvous home of `key` among the candidates, passed over while at the load bound."""
    by_url = {w.url: w for w in candidates}
    return by_url[place(_RINGS.get(list(by_url)), key, [w.load for w in by_url.values()])]


def choose(candidates: Sequence[C], keys: Sequence[str], load_gap: int) -> tuple[C, Route]:
    """The decoder for a request with `keys` (see the module's rule) and how it was chosen: a hit (it holds the
    longest prefix any candidate holds), overloaded (one that holds longer is too busy) or a miss (none holds any)."""
    least = least_loaded(candidates)
    depths = [w.prefixes.depth(keys) for w in candidates] if keys else [0]
    deepest = max(depths)
    if not deepest:
        return (_home(candidates, keys[0]) if keys else least), "miss"
    room = [(d, w) for d, w in zip(depths, candidates, strict=True) if w.load <= least.load + load_gap]
    depth, chosen = max(room, key=lambda dw: (dw[0], -dw[1].load))  # the first of equals: stable
    return chosen, "hit" if depth == deepest else "overloaded"
