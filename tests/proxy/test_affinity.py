"""Prefix affinity (scheduler/affinity.py): a request goes to the decoder holding the longest prefix of its keys, as
its /health reports them plus the requests it finished since, unless that decoder is more than the load gap
busier than the least-loaded one; a miss goes to its first key's rendezvous home; garbage in /health never breaks
routing."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from proxy.worker_state import Worker
from proxy.workers import Workers
from scheduler.affinity import MAX_RECENT_KEYS, MAX_REPORTED_KEYS, Route
from scheduler.rendezvous import Ring

KEYS = ["k0", "k1", "k2", "k3"]  # one request's prefix keys (messages[:1] .. messages[:4])


def decoders(gap: int | None = 4, urls: tuple[str, ...] = ("http://a", "http://b")) -> tuple[Workers, list[Route]]:
    """Healthy decoders that keep a prefix cache, and the routes each choice reported."""
    routes: list[Route] = []
    workers = Workers(None, 1.0, 1.0, 3, on_up=lambda w: None, on_down=lambda w: None,  # type: ignore[arg-type]
                      load_gap=gap, on_route=routes.append)
    for url in urls:
        worker = workers.add("decoder", url)
        worker.healthy = True
        worker.prefixes.update({"enabled": True, "keys": []}, worker.prefixes.probe_started())
    return workers, routes


def holding(worker: Worker, keys: list[str]) -> Worker:
    worker.prefixes.update({"enabled": True, "keys": keys}, worker.prefixes.probe_started())
    return worker


def home(workers: Workers, key: str) -> str:
    """Where a miss goes when every decoder is idle: the rendezvous home of the request's first key."""
    return Ring(list(workers.by_url)).home(key)


def pick(workers: Workers, keys: list[str] = KEYS, exclude: set[str] | None = None) -> str:
    """The decoder chosen for a request with `keys`, released at once (its load unchanged)."""
    worker = workers.acquire_decoder(exclude or set(), keys)
    worker.load -= 1
    return worker.url


def test_the_decoder_holding_the_longest_prefix_wins() -> None:
    workers, routes = decoders()
    a, b = workers.by_url["http://a"], workers.by_url["http://b"]
    holding(a, ["k0"])
    holding(b, ["k0", "k2"])
    assert pick(workers) == "http://b"
    holding(a, ["k3"])
    assert pick(workers) == "http://a"
    assert pick(workers, exclude={"http://a"}) == "http://b"  # failover still excludes
    # nobody holds it: its first key's rendezvous home, every decoder being idle; no keys at all: by load
    assert pick(workers, ["other", "k9"]) == home(workers, "other") and pick(workers, []) == "http://a"
    assert routes == ["hit", "hit", "hit", "miss", "miss"]


@pytest.mark.parametrize("gap", [0, 4])
def test_a_holder_keeps_its_requests_up_to_the_load_gap_and_not_beyond(gap: int) -> None:
    workers, routes = decoders(gap, ("http://a", "http://b", "http://c"))
    a, b, c = (workers.by_url[u] for u in ("http://a", "http://b", "http://c"))
    holding(a, KEYS)
    holding(b, ["k0"])
    b.load, c.load = 1, 1
    a.load = 1 + gap
    assert pick(workers) == "http://a"
    a.load = 2 + gap  # past the gap: the next longest holder with room, which is b
    assert pick(workers) == "http://b"
    b.load = 2 + gap  # and with no holder in range, the least loaded
    assert pick(workers) == "http://c"
    assert routes == ["hit", "overloaded", "overloaded"]


def test_affinity_off_is_by_load_alone() -> None:
    workers, routes = decoders(gap=None)
    holding(workers.by_url["http://b"], KEYS)
    assert pick(workers) == "http://a" and routes == []


def test_keys_of_finished_requests_count_until_a_probe_started_after_they_finished() -> None:
    health = {"enabled": True, "keys": []}
    late = ["late0"]

    async def main() -> list[str]:
        async def answer(request: httpx.Request) -> httpx.Response:
            if late[0] not in a.prefixes.recent:  # finishes while the first probe is in flight: not in its /health
                a.prefixes.finished(late)
            return httpx.Response(200, json={"status": "ok", "prefix_cache": health})

        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            workers.client = client
            seen = [pick(workers, ["x", *KEYS[:2]])]
            await workers.probe(a)
            seen += [pick(workers, KEYS[:2]), pick(workers, late)]
            await workers.probe(a)  # started after `late` finished, and its /health does not list it: gone
            seen.append(pick(workers, late))
            return seen

    workers, _ = decoders(urls=("http://b", "http://a"))  # by load, b would be chosen
    a = workers.by_url["http://a"]
    a.prefixes.finished(KEYS[:2])
    assert asyncio.run(main()) == ["http://a", home(workers, KEYS[0]), "http://a", home(workers, late[0])]


def test_a_decoder_without_a_prefix_cache_collects_no_keys() -> None:
    workers, _ = decoders(urls=("http://b", "http://a"))
    a = workers.by_url["http://a"]
    for report in (None, {"enabled": False, "keys": KEYS}):
        a.prefixes.update(report, a.prefixes.probe_started())
        a.prefixes.finished(KEYS)
        assert pick(workers) == "http://b" and not a.prefixes.recent


def test_finished_keys_are_bounded_oldest_first() -> None:
    workers, _ = decoders()
    a = workers.by_url["http://a"]
    for i in range(MAX_RECENT_KEYS + 10):
        a.prefixes.finished([f"r{i}"])
    assert len(a.prefixes.recent) == MAX_RECENT_KEYS and "r0" not in a.prefixes.recent
    assert a.prefixes.depth(["r9", f"r{MAX_RECENT_KEYS + 9}"]) == 2


GARBAGE: list[Any] = [
    "keys", 17, [], {"keys": "k1"}, {"keys": {"k1": True}}, {"keys": None}, {"enabled": "yes", "keys": 3},
    {"keys": [1, None, {"k": 1}, ["k1"], "", "k" * 65, "k1"]},  # only the one string of a key's shape counts
    {"keys": [f"g{i}" for i in range(100_000)] + ["k1"]},  # huge: capped, the tail is not read
]


@pytest.mark.parametrize("report", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_prefix_cache_in_health_is_ignored_or_capped(report: Any) -> None:
    async def main() -> tuple[bool, str, int]:
        body = {"status": "ok", "prefix_cache": report}
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, json=body))) as client:
            workers.client = client
            healthy = await workers.probe(b)
            return healthy, pick(workers, ["k0", "k1"]), len(b.prefixes.reported)

    workers, routes = decoders()
    b = workers.by_url["http://b"]
    healthy, chosen, num_reported = asyncio.run(main())
    holds_k1 = isinstance(report, dict) and isinstance(report.get("keys"), list) and len(report["keys"]) < 10
    assert healthy and num_reported <= MAX_REPORTED_KEYS
    assert chosen == ("http://b" if holds_k1 else home(workers, "k0")) and routes == ["hit" if holds_k1 else "miss"]


def test_a_miss_goes_to_one_decoder_from_every_proxy_and_moves_on_at_the_load_bound() -> None:
    urls = tuple(f"http://d{i}" for i in range(4))
    one, _ = decoders(urls=urls)
    two, _ = decoders(urls=tuple(reversed(urls)))  # another proxy, its decoders listed in another order
    firsts = [f"first-message-{i}" for i in range(24)]
    assert [pick(one, [k, "k1"]) for k in firsts] == [pick(two, [k]) for k in firsts]
    assert {pick(one, [k]) for k in firsts} == set(urls)  # conversations are spread over every decoder
    key = firsts[0]
    ranking = Ring(list(urls)).ranking(key)
    one.by_url[ranking[0]].load = 2  # bound with 2 in flight on 4 decoders: ceil(1.25 * 3 / 4) = 1
    assert pick(one, [key]) == ranking[1]
