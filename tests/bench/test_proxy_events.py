"""epd_bench.proxy_events times the proxy's event hand-over beside a plain `async for` over the same events."""
from __future__ import annotations

import asyncio

from epd_bench.proxy_events import _Events, measure
from epd_contracts.generate import Event
from proxy.streaming import batches_apart


def test_the_proxy_hand_over_yields_every_event_in_order() -> None:
    async def collect() -> list[Event]:
        return [ev async for batch in batches_apart(_Events(50)) for ev in batch]  # type: ignore[arg-type]

    assert asyncio.run(collect()) == [Event(type="delta", text="x")] * 50


def test_both_paths_are_measured_per_event() -> None:
    result = asyncio.run(measure(200, 1))
    assert set(result) == {"plain_us_per_event", "proxy_us_per_event", "ratio"}
    assert result["plain_us_per_event"] > 0 and result["proxy_us_per_event"] > 0 and result["ratio"] > 0
