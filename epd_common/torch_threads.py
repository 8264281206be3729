"""Torch work that must not leave an OpenMP thread team behind (the CPU engine's spin-waits depend on it).

libgomp gives every thread that starts a parallel region a team of worker threads of its own, kept until that
thread ends. Once the teams of a process hold more threads than it has CPUs, libgomp throttles every team: its
workers spin about 100 times at a barrier, instead of about 300,000, before they sleep in the kernel. A decoder that
loaded its model on an executor thread and built its engine on the event loop's thread had three teams, so the
engine thread's workers went to sleep and were woken between nearly all of its ops (41,000 voluntary context
switches in one 64-in-flight level of `epd_bench.vllm_compare`'s load, 1,600 without; docs/BENCHMARKS.md).

`on_passing_thread` runs setup work (loading weights, packing them, zeroing the K/V pool) on a thread that ends when
it returns, which takes its team with it, so the engine thread, which runs the forwards, keeps the only team.
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_passing_thread(fn: Callable[[], T], name: str = "epd-setup") -> T:
    """fn() on a new thread (in this thread's context) that has ended when this returns, and its OpenMP team with
    it; fn's result, or its exception raised here."""
    context = contextvars.copy_context()
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(context.run(fn))
        except BaseException as exc:  # noqa: BLE001 - raised again on the calling thread
            failed.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return done[0]


async def setup_off_loop(fn: Callable[[], T], name: str = "epd-setup") -> T:
    """`on_passing_thread(fn)` without blocking the event loop (an executor thread waits for it, doing no torch
    work of its own)."""
    return await asyncio.to_thread(on_passing_thread, fn, name)
