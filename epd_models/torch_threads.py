"""Torch work that must not leave an OpenMP thread team behind (the CPU engine's spin-waits depend on it).

libgomp gives every thread that starts a parallel region a team of worker threads of its own, kept until that
thread ends. Once the teams of a process hold more threads than it has CPUs, libgomp throttles every team: its
workers spin about 100 times at a barrier, instead of about 300,000, before they sleep in the kernel. A decoder that
loaded its model on an executor thread and built its engine on the event loop's thread had three teams, so the
engine thread's workers went to sleep and were woken between nearly all of its ops (41,000 voluntary context
switches in one 64-in-flight level of `epd_bench.vllm_compare`'s load, 1,600 without; docs/BENCHMARKS.md).

`on_passing_thread` runs setup work (loading weights, packing them, zeroing the K/V pool) on a thread that ends when
it returns, which takes its team with it, so the engine thread, which runs the forwards, keeps the only team.
`torch_on_one_thread` is the initializer of threads that live on and do some torch work (the decoder's request
preparation: embedding checks, prompt assembly): their ops run on them alone, so they start no team. A decoder's
executor threads did, at its first image request (16 in flight of text afterwards: 8,200 voluntary context
switches per level instead of 400, 9-13 % fewer tokens/s).
"""
from __future__ import annotations

import asyncio
import contextvars
import ctypes
import os
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


def torch_on_one_thread() -> None:
    """From now on this thread's torch ops run on it alone and start no OpenMP team (a thread pool's initializer).
    Only this thread's OpenMP setting changes: `torch.set_num_threads` would also change the count every thread
    that has not run torch yet starts with (the engine thread's included)."""
    import torch

    torch.get_num_threads()  # torch sets a thread's OpenMP count at its first use: before ours, not after
    gomp = _openmp_runtime()
    if gomp is not None:
        gomp.omp_set_num_threads(1)


def _openmp_runtime() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's, found by its file in /proc/self/maps: loading it by name could
    load another copy), or None (no libgomp: another runtime or none, and nothing to do)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {fields[5] for line in maps if len(fields := line.split(maxsplit=5)) == 6}
    except OSError:
        return None
    found = sorted(p.strip() for p in paths if os.path.basename(p.strip()).startswith("libgomp") and ".so" in p)
    return ctypes.CDLL(found[0]) if found else None
