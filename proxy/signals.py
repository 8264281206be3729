"""Startup waits that SIGTERM and Ctrl-C can interrupt.

uvicorn's signal handlers only set a flag, which it reads once the lifespan's startup is over; a long
wait there (for workers) would otherwise ignore both signals until it ends.
"""
from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable
from types import FrameType
from typing import TypeVar

T = TypeVar("T")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived during the wait."""


async def unless_signalled(aw: Awaitable[T]) -> T:
    """Await `aw`; on SIGTERM/SIGINT cancel it and raise Interrupted. The handlers already installed (uvicorn's)
    still run, so the server exits after the lifespan returns. Off the main thread (tests): a plain await."""
    if threading.current_thread() is not threading.main_thread():
        return await aw
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(aw)
    previous: dict[int, object] = {}
    hit: list[int] = []

    def handler(sig: int, frame: FrameType | None) -> None:
        hit.append(sig)
        loop.call_soon_threadsafe(task.cancel)
        prev = previous.get(sig)
        if callable(prev):
            prev(sig, frame)

    for sig in _SIGNALS:
        previous[sig] = signal.signal(sig, handler)
    try:
        return await task
    except asyncio.CancelledError:
        if hit:
            raise Interrupted(signal.Signals(hit[0]).name) from None
        raise
    finally:
        for num, prev in previous.items():
            signal.signal(num, prev)  # type: ignore[arg-type]
        for num in hit:
            if not callable(previous.get(num)):  # SIG_DFL / SIG_IGN: let it do what it would have done
                signal.raise_signal(num)
