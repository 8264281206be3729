"""503 encoder_busy is "busy", not "down" (proxy/fleet.py): the call moves to another encoder, waits the encoder's
Retry-After when every encoder is busy, and ends in 503 encoders_saturated past --encoder-busy-timeout. Scripted
encoders as in test_fleet.py."""
from __future__ import annotations

import asyncio
import dataclasses

import httpx

from epd_common.errors import APIError
from tests.homes import homed_on
from tests.proxy.test_fleet import (
    URLS,
    Encoders,
    address,
    encoded,
    fleet_of,
    items,
    producers,  # noqa: F401  # its autouse fixture: the encoders' ZeroMQ side
)

BUSY = {"error": {"message": "encoder busy", "code": "encoder_busy"}}


ON_FIRST = homed_on(URLS, URLS[0])[0]  # an item whose rendezvous home is 9100: its first call goes there


def test_a_busy_encoders_items_go_to_another_and_a_busy_fleet_waits_then_is_served() -> None:
    """503 encoder_busy is "busy", not "down": the call moves to the other encoder (no failover counted, nobody
    marked down); when every encoder is busy the call waits the Retry-After and is tried again."""
    answers = {"http://127.0.0.1:9100": ["busy"] * 3, "http://127.0.0.1:9101": ["busy", "ok"]}

    async def scripted(url: str, hashes: list[str]) -> httpx.Response:
        await asyncio.sleep(0)
        if answers[url] and answers[url].pop(0) == "busy":
            return httpx.Response(503, json=BUSY, headers={"Retry-After": "0.05"})
        return encoded(url, hashes)

    encoders = Encoders(scripted)

    async def main() -> tuple[dict[str, str], list[bool], float, float]:
        async with fleet_of(encoders) as fleet:
            sources = await fleet.encode(items(ON_FIRST), "rid")
            busy = fleet.metrics.encoder_busy._value.get()
            failovers = fleet.metrics.failovers.labels("encoder")._value.get()
            return sources, [w.healthy for w in fleet.workers.of("encoder")], busy, failovers

    sources, healthy, busy, failovers = asyncio.run(main())
    assert healthy == [True, True] and failovers == 0
    # 9100 busy -> 9101 busy -> all busy: wait, 9101 (its call) busy... until one answers
    assert busy == len(encoders.calls) - 1 and encoders.calls[0][0].endswith("9100")
    assert set(sources.values()) <= {address("http://127.0.0.1:9100"), address("http://127.0.0.1:9101")}


def test_every_encoder_busy_past_the_deadline_is_a_503_encoders_saturated_for_every_request_waiting() -> None:
    async def always_busy(url: str, hashes: list[str]) -> httpx.Response:
        await asyncio.sleep(0)
        return httpx.Response(503, json=BUSY, headers={"Retry-After": "0.05"})

    encoders = Encoders(always_busy)

    async def main() -> tuple[list[APIError], list[bool]]:
        async with fleet_of(encoders) as fleet:
            fleet.cfg = dataclasses.replace(fleet.cfg, encoder_busy_timeout=0.3)
            errors = []
            for request in await asyncio.gather(fleet.encode(items("a"), "r1"), fleet.encode(items("a"), "r2"),
                                                return_exceptions=True):
                assert isinstance(request, APIError)
                errors.append(request)
            return errors, [w.healthy for w in fleet.workers.of("encoder")]

    errors, healthy = asyncio.run(main())
    assert [(e.status, e.code) for e in errors] == [(503, "encoders_saturated")] * 2 and healthy == [True, True]
    assert errors[0].headers == {"Retry-After": "0.05"} and "saturated" in errors[0].message
    assert len(encoders.calls) >= 4  # each encoder tried, then tried again after each wait
