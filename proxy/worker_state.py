"""One worker as the proxy holds it: role, health, load and the prefixes it holds, and its calls in flight, cut
short the moment it is marked down; and why a call to it failed, for the log."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from scheduler.affinity import HeldPrefixes

T = TypeVar("T")


class WorkerDown(Exception):
    """The worker was marked down while a call to it was in flight."""


def describe_failure(exc: BaseException) -> str:
    """Why a call could not reach a worker, for the log: refused, DNS, timeout, ... with the error text."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        kind = "timeout"
    elif "Name or service not known" in text or "nodename nor servname" in text or "Temporary failure in name" in text:
        kind = "DNS lookup failed"
    elif "refused" in text.lower() or isinstance(exc, httpx.ConnectError):
        kind = "cannot connect (refused or unreachable)"
    else:
        kind = type(exc).__name__
    return f"{kind} ({text})" if kind not in text else text


@dataclass
class Worker:
    role: str  # "encoder" | "decoder"
    url: str
    healthy: bool = False  # only healthy workers get new work
    failures: int = 0  # consecutive failed probes
    info: dict[str, Any] = field(default_factory=dict)  # its last /health body
    load: int = 0  # decoders: generations in flight
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set when marked down: in-flight calls give up
    reason: str = "not probed yet"
    logged_at: float = float("-inf")  # monotonic time its unreachability was last logged (rate limit)
    prefixes: HeldPrefixes = field(default_factory=HeldPrefixes)  # decoders: prompt prefixes it holds (affinity)
    calls: set[asyncio.Future[Any]] = field(default_factory=set)  # calls in flight (until_down), cancelled when down

    def set_down(self) -> None:
        """Calls in flight give up (until_down raises WorkerDown in each); later ones are refused at once."""
        self.down.set()
        for call in list(self.calls):
            call.cancel()

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "load": self.load,
                **({} if self.healthy else {"reason": self.reason})}


async def until_down(call: Awaitable[T], worker: Worker) -> T:
    """Await `call`, but raise WorkerDown (cancelling it) as soon as the worker is marked down (Worker.set_down).

    One task per call and no watcher: marking down cancels the calls registered here (measured: a watcher task and
    asyncio.wait per call cost the proxy ~40 us a request over two calls)."""
    if worker.down.is_set():
        if asyncio.iscoroutine(call):
            call.close()  # never started: no "never awaited" warning
        raise WorkerDown(worker.url)
    task = asyncio.ensure_future(call)
    worker.calls.add(task)
    try:
        return await task
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if task.cancelled() and worker.down.is_set() and (me is None or not me.cancelling()):
            raise WorkerDown(worker.url) from None  # cancelled by set_down, not by our own caller
        raise
    finally:
        worker.calls.discard(task)
