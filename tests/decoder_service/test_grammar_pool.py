"""CompilePool: compiles in FIFO order on their own slots; a waiter that gives up never leaves a queued compile to
run, and a running one it abandons hands its slot on. Compiles here are test doubles blocked on Events."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from decoder_service.grammar_pool import Abandoned, CompilePool
from tests.decoder_service.engine_run import wait_until


class Blocked:
    """A compile that says when it started and waits for `release`."""

    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self) -> str:
        self.log.append(self.name)
        self.started.set()
        assert self.release.wait(30)
        return self.name


def run(main: Callable[[], Any]) -> Any:
    return asyncio.run(main())


def test_a_queued_compile_whose_client_left_never_runs() -> None:
    pool, log = CompilePool(threads=1, timeout=60), []
    first, second = Blocked("first", log), Blocked("second", log)

    async def main() -> None:
        left = asyncio.get_running_loop().create_future()
        running = asyncio.create_task(pool.run(first, asyncio.get_running_loop().create_future()))
        await asyncio.to_thread(first.started.wait, 30)
        queued = asyncio.create_task(pool.run(second, left))
        assert await asyncio.to_thread(wait_until, lambda: pool.num_queued == 1)
        left.set_result(None)  # the second client goes away while queued
        with pytest.raises(Abandoned, match="left"):
            await queued
        assert pool.num_queued == 0
        first.release.set()
        assert await running == "first"

    run(main)
    assert wait_until(lambda: pool.num_running == 0)
    assert log == ["first"]  # the second compile never ran
    pool.close()


def test_a_running_compile_abandoned_hands_its_slot_to_the_next() -> None:
    """Its client left: it finishes on a spare thread, and the queued compile runs meanwhile."""
    pool, log = CompilePool(threads=1, timeout=60), []
    hostile, ordinary = Blocked("hostile", log), Blocked("ordinary", log)
    ordinary.release.set()

    async def main() -> str:
        left = asyncio.get_running_loop().create_future()
        abandoned = asyncio.create_task(pool.run(hostile, left))
        await asyncio.to_thread(hostile.started.wait, 30)
        waiting = asyncio.create_task(pool.run(ordinary, asyncio.get_running_loop().create_future()))
        left.set_result(None)
        with pytest.raises(Abandoned):
            await abandoned
        result: str = await waiting  # runs while the abandoned one is still blocked
        assert not hostile.release.is_set() and pool.num_spare == 1
        return result

    assert run(main) == "ordinary"
    hostile.release.set()
    assert wait_until(lambda: pool.num_spare == 0 and pool.num_running == 0)
    pool.close()


def test_spare_threads_are_bounded_an_abandoned_compile_past_them_keeps_its_slot() -> None:
    pool, log = CompilePool(threads=1, timeout=60), []
    a, b, c = Blocked("a", log), Blocked("b", log), Blocked("c", log)
    c.release.set()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for blocked in (a, b):  # each started, then abandoned by its client
            left = loop.create_future()
            task = asyncio.create_task(pool.run(blocked, left))
            await asyncio.to_thread(blocked.started.wait, 30)
            left.set_result(None)
            with pytest.raises(Abandoned):
                await task
        assert (pool.num_spare, pool.num_running) == (1, 1)  # b could not move to a spare: it holds the slot
        third = asyncio.create_task(pool.run(c, loop.create_future()))
        assert await asyncio.to_thread(wait_until, lambda: pool.num_queued == 1)
        a.release.set()  # a spare frees; b still holds the slot, so c still waits
        assert await asyncio.to_thread(wait_until, lambda: pool.num_spare == 0)
        assert pool.num_queued == 1 and not c.started.is_set()
        b.release.set()
        assert await third == "c"

    run(main)
    assert log == ["a", "b", "c"]
    pool.close()


def test_a_compile_running_past_the_timeout_is_abandoned_as_timeout() -> None:
    pool, log = CompilePool(threads=1, timeout=0.05), []
    slow = Blocked("slow", log)

    async def main() -> None:
        with pytest.raises(Abandoned, match="timeout"):
            await pool.run(slow, asyncio.get_running_loop().create_future())

    run(main)
    assert slow.started.is_set() and pool.num_spare == 1 and pool.num_running == 0
    slow.release.set()
    assert wait_until(lambda: pool.num_spare == 0)
    pool.close()


def test_a_compile_error_reaches_its_waiter() -> None:
    pool = CompilePool(threads=2, timeout=60)

    def broken() -> None:
        raise ValueError("bad grammar")

    async def main() -> None:
        with pytest.raises(ValueError, match="bad grammar"):
            await pool.run(broken, asyncio.get_running_loop().create_future())

    run(main)
    assert wait_until(lambda: pool.num_running == 0)
    pool.close()
