"""Proxy micro-benchmark: what handing one decoder event to a client stream costs (proxy/streaming.py `batches_apart`,
a reader task per stream and a bounded queue) next to a plain `async for` over the same events.

    python -m epd_bench.proxy_events [--events 20000] [--rounds 5] [--json]

Rounds alternate the two, so machine noise hits both; the result is microseconds per event and their ratio.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator

from epd_bench.micro import emit, parser
from epd_contracts.generate import Event
from proxy.streaming import batches_apart


class _Events:
    """A stand-in for proxy.generation.Generation: `events()` yields decoder events as fast as they are read."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def events(self) -> AsyncIterator[Event]:
        for _ in range(self.n):
            yield Event(type="delta", text="x")


async def _per_event_us(n: int, apart: bool) -> float:
    source = _Events(n)
    start = time.perf_counter()
    if apart:
        async for _ in batches_apart(source):  # type: ignore[arg-type]
            pass
    else:
        async for _ in source.events():
            pass
    return (time.perf_counter() - start) / n * 1e6


async def measure(n: int, rounds: int) -> dict[str, float]:
    plain, apart = [], []
    for _ in range(rounds):
        plain.append(await _per_event_us(n, apart=False))
        apart.append(await _per_event_us(n, apart=True))
    p, a = statistics.median(plain), statistics.median(apart)
    return {"plain_us_per_event": round(p, 3), "proxy_us_per_event": round(a, 3), "ratio": round(a / p, 1)}


def main(argv: list[str] | None = None) -> None:
    p = parser("proxy_events", __doc__)
    p.add_argument("--events", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    emit(asyncio.run(measure(args.events, args.rounds)), args.json, lambda r: (
        f"plain async for: {r['plain_us_per_event']} us/event; proxy hand-over: {r['proxy_us_per_event']} us/event "
        f"({r['ratio']}x)"))


if __name__ == "__main__":
    main()
