"""Grammar compiles on a few threads of their own (--grammar-compile-threads), never on the threads that prepare
every request: a request without a grammar never waits behind a compile, however many are queued.

A compile waits in this pool's FIFO for one of `threads` slots. A waiter that gives up (its client left, or the
compile ran past --grammar-compile-timeout) `abandon`s it: a compile that has not started never runs; one that is
running cannot be stopped (the library compiles in native code and offers no cancel), so it finishes on one of
`threads` spare threads and its slot goes to the next in the queue at once. Only when the spares are busy too
does it keep its slot: at most 2 x `threads` compiles ever run at once.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Abandoned(Exception):
    """The waiter gave up on its compile: `reason` is "left" (the client went away) or "timeout"."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class _Task(Generic[T]):
    fn: Callable[[], T]
    future: Future[T] = field(default_factory=Future)
    started_at: float | None = None  # time.monotonic() when it started running
    spare: bool = False  # abandoned while running: finishing on a spare thread, holding no slot
    ended: bool = False


class CompilePool:
    """`threads` compile slots in FIFO order, plus as many spare threads for abandoned running compiles."""

    def __init__(self, threads: int, timeout: float):
        assert threads >= 1 and timeout > 0, "grammar compile threads >= 1 and timeout > 0"
        self.threads, self.timeout = threads, timeout
        self.num_running = 0  # compiles holding a slot
        self.num_spare = 0  # abandoned compiles still running on a spare thread
        self._queue: deque[_Task[Any]] = deque()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=2 * threads, thread_name_prefix="epd-grammar")

    @property
    def num_queued(self) -> int:
        """Compiles waiting for a slot."""
        return len(self._queue)

    async def run(self, fn: Callable[[], T], left: asyncio.Future[Any]) -> T:
        """fn() on a compile slot; raises Abandoned when `left` completes first, or fn runs past the timeout."""
        task: _Task[T] = _Task(fn)
        self._submit(task)
        result = asyncio.wrap_future(task.future)
        while True:
            wait_s = self.timeout / 4 if task.started_at is None else task.started_at + self.timeout - time.monotonic()
            await asyncio.wait({result, left}, timeout=max(wait_s, 0), return_when=asyncio.FIRST_COMPLETED)
            if result.done():
                return result.result()
            if left.done() or (task.started_at is not None and time.monotonic() - task.started_at >= self.timeout):
                self._abandon(task)
                result.cancel()
                raise Abandoned("left" if left.done() else "timeout")

    def close(self) -> None:
        with self._lock:
            for task in self._queue:
                task.future.cancel()
            self._queue.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _submit(self, task: _Task[Any]) -> None:
        with self._lock:
            self._queue.append(task)
        self._pump()

    def _abandon(self, task: _Task[Any]) -> None:
        with self._lock:
            if task.future.cancel():  # still queued: it never runs (nor holds its spec any longer)
                self._queue.remove(task)
                return
            if not task.ended and not task.spare and self.num_spare < self.threads:
                task.spare, self.num_spare, self.num_running = True, self.num_spare + 1, self.num_running - 1
        self._pump()

    def _pump(self) -> None:
        """Start queued compiles while a slot is free (a cancelled one is dropped)."""
        with self._lock:
            while self._queue and self.num_running < self.threads:
                task = self._queue.popleft()
                if not task.future.set_running_or_notify_cancel():
                    continue
                task.started_at, self.num_running = time.monotonic(), self.num_running + 1
                self._executor.submit(self._work, task)

    def _work(self, task: _Task[Any]) -> None:
        try:
            task.future.set_result(task.fn())
        except BaseException as exc:  # noqa: BLE001 - the waiter gets it
            task.future.set_exception(exc)
        finally:
            with self._lock:
                task.ended = True
                if task.spare:
                    self.num_spare -= 1
                else:
                    self.num_running -= 1
            self._pump()
