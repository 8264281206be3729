"""Waiting in a test for the event it depends on: the condition is checked until it holds, under a deadline that only
guards against a hang (far above what a busy machine takes), never a fixed sleep or an elapsed-time assertion.

A condition with an event of its own (an asyncio.Event, a threading.Event, a future) is awaited as such, under
`HANG_S`; these are for state that can only be looked at (a counter, a file, another thread's queue)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

HANG_S = 120.0  # seconds: a hang guard, not a timing target


def wait_for(check: Callable[[], object], what: str = "the condition", timeout: float = HANG_S,
             interval: float = 0.01) -> None:
    """Return once `check()` is true; TimeoutError naming `what` if it is still false after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still not so after {timeout:g} s")
        time.sleep(interval)


async def until(check: Callable[[], object], what: str = "the condition", timeout: float = HANG_S,
                interval: float = 0.005) -> None:
    """wait_for in a coroutine: the event loop runs meanwhile."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still not so after {timeout:g} s")
        await asyncio.sleep(interval)
