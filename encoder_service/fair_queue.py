"""The encoder's one encode thread, shared fairly: calls wait in one queue per request id, taken round-robin.

A video request arrives as many /encode calls at once (one per chunk, proxy/fleet.py `encode_calls`), all with
its request id. With one FIFO queue every call that arrives after them (another user's image) waits for all of
them; here the thread takes the oldest call of the next request id in turn, so a call waits for at most one
call of each other request ahead of it, whatever their number of calls.
"""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
_Job = tuple[Future[Any], Callable[[], Any]]


class FairExecutor:
    """One worker thread; `run(key, fn)` queues fn under `key`, and the thread serves the keys in turn."""

    def __init__(self, thread_name: str = "epd-encode") -> None:
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # key -> its calls, oldest first; keys in turn
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._thread.start()

    async def run(self, key: str, fn: Callable[[], T]) -> T:
        """fn() on the thread, in `key`'s turn. Cancelling the await drops a call that has not started."""
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the encode thread is shut down")
            self._queues.setdefault(key, deque()).append((future, fn))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def _next(self) -> _Job | None:
        """The oldest call of the key whose turn it is (that key goes to the back); None once shut down."""
        with self._cond:
            while not self._queues and not self._closed:
                self._cond.wait()
            if not self._queues:
                return None
            key, calls = next(iter(self._queues.items()))
            job = calls.popleft()
            del self._queues[key]
            if calls:
                self._queues[key] = calls  # to the back: every other key's call comes first
            return job

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue  # its caller left before it started
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it; the thread goes on
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Finish the calls queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
