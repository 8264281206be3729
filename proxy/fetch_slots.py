"""A cap on the proxy's blocking media loads: a semaphore shared by all requests and a thread pool of its own."""
from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from epd_common.errors import APIError

T = TypeVar("T")
GRACE_S = 1.0  # past the deadline, the thread's own error (which names the image) normally comes first


class FetchSlots:
    """At most `size` blocking media loads at once over all requests, on threads of their own.

    A request waits for a slot until its deadline (then 503 `media_fetch_busy`); the slot is given back when
    the thread is done, not when the waiting request goes away, so the cap holds for threads still reading.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = asyncio.Semaphore(size)
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="epd-fetch")

    async def run(self, deadline: float, fn: Callable[..., T], *args: Any,
                  timeout_code: str = "image_fetch_timeout") -> T:
        """fn(*args) on a slot; 503 media_fetch_busy if none frees up by `deadline`, 408 `timeout_code` if the
        thread is still running a grace period after it."""
        try:
            await asyncio.wait_for(self._free.acquire(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise APIError(503, f"all {self.size} media fetch slots stayed busy until this request's media fetch "
                                "deadline; retry later", code="media_fetch_busy") from None
        ctx = contextvars.copy_context()  # the request id reaches the thread's log lines
        future = asyncio.get_running_loop().run_in_executor(self._pool, ctx.run, fn, *args)
        future.add_done_callback(lambda _: self._free.release())
        try:  # shielded: a request that leaves (or times out) does not free the slot of a thread still running
            return await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - time.monotonic()) + GRACE_S)
        except TimeoutError:  # the thread is stuck where no timeout reaches (name resolution)
            raise APIError(408, "the request's media were not loaded within the media fetch deadline",
                           code=timeout_code) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
