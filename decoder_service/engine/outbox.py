"""Events from the engine thread to each request's asyncio loop, in order, one wakeup of a loop for every event
queued since its last (`Outbox`); inside `held_events()` (or between `hold_events()` and `release_events()`) events
only queue, and go out when it ends."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Iterator

from epd_contracts.generate import Event


class Outbox:
    """Events for one asyncio loop from the engine thread, in order; one wakeup of the loop carries every event queued
    since the last. The engine emits an event per row per step: a wakeup each cost a write to the loop's pipe and
    a hand-over of the GIL to the loop's thread in the middle of the step. Inside `held_events()` events only queue,
    and go out when it ends (the engine holds them for a step's postprocess, so the loop's thread handles them
    while the next forward runs, which releases the GIL)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[asyncio.Queue[Event], Event]] = []
        self._scheduled = False  # a drain is on its way to the loop
        self._lock = threading.Lock()

    def put(self, queue: asyncio.Queue[Event], event: Event) -> None:
        if self.loop.is_closed():  # as call_soon_threadsafe says it; the request fails, as before
            raise RuntimeError("Event loop is closed")
        with self._lock:
            self._items.append((queue, event))
        held: set[Outbox] | None = getattr(_held, "boxes", None)
        if held is not None:
            held.add(self)
        else:
            self.flush()

    def flush(self) -> None:
        """Wake the loop for the queued events (unless a wakeup is already on its way); a closed loop drops them."""
        with self._lock:
            if self._scheduled or not self._items:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed since the put: nobody is left to read them
            with self._lock:
                self._items, self._scheduled = [], False

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, event in items:
            queue.put_nowait(event)


_held = threading.local()  # .boxes: the outboxes holding events on this thread (inside held_events)
_outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()
_outboxes_lock = threading.Lock()


def outbox(loop: asyncio.AbstractEventLoop) -> Outbox:
    """The one outbox of `loop` (every job of a loop shares it, so their events share its wakeups)."""
    with _outboxes_lock:
        box = _outboxes.get(loop)
        if box is None:
            box = _outboxes[loop] = Outbox(loop)
        return box


@contextlib.contextmanager
def held_events() -> Iterator[None]:
    """Events emitted on this thread inside go to their loops when it ends, one wakeup per loop."""
    if getattr(_held, "boxes", None) is not None:  # nested: the outer one flushes
        yield
        return
    hold_events()
    try:
        yield
    finally:
        release_events()


def hold_events() -> None:
    """From now on, events emitted on this thread queue until `release_events()` (the engine: from a step's
    postprocess to the next forward, so each loop's thread handles them while that forward runs, which releases the
    GIL, instead of taking the GIL from the next step's host work)."""
    if getattr(_held, "boxes", None) is None:
        _held.boxes = set()


def release_events() -> None:
    """Every loop with events held on this thread gets one wakeup; events go out at once again (a no-op unheld)."""
    boxes, _held.boxes = getattr(_held, "boxes", None), None
    for box in boxes or ():
        box.flush()
