"""The encoder's one encode thread, shared by every /encode call: their items in one queue, run as batched vision
forwards within a budget, each request served in turn, and work past a bound refused at admission.

- Items, not calls, are the unit: a call's images (and video parts' frames) are decoded before they queue
  (encoder_service/server.py), and the thread takes a batch of one group (`Job.group`: images of one detail and
  multi-image kind, or video parts; a family that does not batch exactly runs each item alone) across calls, within
  `max_batch_items` and `max_batch_tokens` (vision tokens, counted by the family's processor:
  `VisionHalf.image_tokens`, a video part as its frames).
- Fairness: the batch's first item is the oldest item of the request whose turn it is (request ids in turn, as the
  old per-call executor did), so a video request's many chunks never hold another user's image behind all of them;
  the rest of the batch is filled in arrival order.
- Admission: `submit` refuses (Busy) a call whose items would take the vision tokens waiting past `max_pending_tokens`
  (unless nothing waits: a call larger than the bound still runs, alone). The server answers 503 with Retry-After;
  the proxy tries another encoder (proxy/fleet.py).
- Faults: a batch that raises is run again item by item, so only the items that fail alone fail their calls.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from epd_common.logs import request_id_var
from epd_models.encode import Encoded, Job
from epd_models.video_jobs import VideoJob

logger = logging.getLogger("epd.encoder")
Runner = Callable[[Sequence[Job]], dict[str, Encoded]]  # one vision forward: a batch of images or of video parts


class Busy(Exception):
    """The pending work is past its bound: try again later, or another encoder."""

    def __init__(self, pending: int, asked: int | None, limit: int, what: str = "vision tokens are waiting"):
        brings = "" if asked is None else f" and this call brings {asked}"
        super().__init__(f"{pending} {what}{brings}; the bound is {limit}")
        self.pending, self.asked, self.limit = pending, asked, limit


@dataclass
class _Item:
    key: str  # the request id: requests take turns
    job: Job
    cost: int  # vision tokens
    future: Future[Encoded]
    queued: float = field(default_factory=time.perf_counter)
    batch: tuple[int, int] = (0, 0)  # the id and size of the vision forward it ran in (set before its future)


@dataclass(frozen=True)
class BatchStats:
    items: int
    tokens: int
    waits: list[float]  # each item's time in the queue, seconds
    seconds: float  # the forward's wall time


class EncodeScheduler:
    def __init__(self, run: Runner, max_batch_items: int = 16, max_batch_tokens: int = 16384,
                 max_pending_tokens: int = 1 << 20, batches_exactly: bool = True,
                 on_batch: Callable[[BatchStats], None] | None = None,
                 on_failed: Callable[[list[str]], None] | None = None, thread_name: str = "epd-encode"):
        """`on_failed`: told the hashes of items that failed for good (the store tells waiting decoders)."""
        assert max_batch_items >= 1 and max_batch_tokens >= 1 and max_pending_tokens >= 1
        self._run, self.on_batch, self.on_failed = run, on_batch, on_failed
        self.max_batch_items = max_batch_items if batches_exactly else 1
        self.max_batch_tokens, self.max_pending_tokens = max_batch_tokens, max_pending_tokens
        self._queues: OrderedDict[str, deque[_Item]] = OrderedDict()  # key -> its items, oldest first; keys in turn
        self._arrival: list[_Item] = []  # every queued item, oldest first (fills a batch)
        self._pending_tokens = 0
        self._cond = threading.Condition()
        self._closed = False
        self.num_batches = 0
        self._batch_ids = itertools.count(1)  # each vision forward's id, this process's (traces name it)
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._thread.start()

    # -- callers (the event loop) ------------------------------------------------------------------------------
    async def submit(self, key: str, jobs: Sequence[tuple[Job, int]],
                     batches: dict[int, int] | None = None) -> dict[str, Encoded]:
        """Queue `jobs` (each with its cost in vision tokens) under request `key`; their results by mm_hash once
        all have run. Raises Busy (nothing queued) past the pending bound; a failed item raises its error (the
        call's others may still run: their results stay in the store). Cancelling drops the items not started.
        `batches`: filled with the id -> size of each vision forward the items ran in."""
        items = [_Item(key, job, max(1, cost), Future()) for job, cost in jobs]
        if not items:
            return {}
        asked = sum(it.cost for it in items)
        with self._cond:
            if self._closed:
                raise RuntimeError("the encode thread is shut down")
            if self._arrival and self._pending_tokens + asked > self.max_pending_tokens:
                raise Busy(self._pending_tokens, asked, self.max_pending_tokens)
            queue = self._queues.setdefault(key, deque())
            queue.extend(items)
            self._arrival.extend(items)
            self._pending_tokens += asked
            self._cond.notify()
        try:
            done = await asyncio.gather(*(asyncio.wrap_future(it.future) for it in items))
        finally:
            for it in items:
                it.future.cancel()  # a no-op once started or done
        if batches is not None:
            batches.update(it.batch for it in items)
        return {it.job.mm_hash: out for it, out in zip(items, done, strict=True)}

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return len(self._arrival)

    @property
    def pending_tokens(self) -> int:
        with self._cond:
            return self._pending_tokens

    def shutdown(self) -> None:
        """Finish what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    # -- the encode thread -------------------------------------------------------------------------------------
    def _next_batch(self) -> list[_Item] | None:
        with self._cond:
            while True:
                while not self._arrival and not self._closed:
                    self._cond.wait()
                if not self._arrival:
                    return None
                batch = self._take()
                if batch:
                    return batch

    def _take(self) -> list[_Item]:
        """The head (the oldest item of the request whose turn it is; that request goes to the back), then other
        images of its group in arrival order within the budget. Items whose caller left are dropped."""
        key, queue = next(iter(self._queues.items()))
        head = queue[0]
        batch = [head]
        tokens = head.cost
        for it in self._arrival:
            if len(batch) >= self.max_batch_items:
                break
            if it is head or it.job.group != head.job.group:  # images of one group, or video parts
                continue
            if tokens + it.cost <= self.max_batch_tokens:
                batch.append(it)
                tokens += it.cost
        taken = {id(it) for it in batch}
        self._arrival = [it for it in self._arrival if id(it) not in taken]
        for it in batch:
            self._pending_tokens -= it.cost
            q = self._queues[it.key]
            q.remove(it)
            if not q:
                del self._queues[it.key]
        if key in self._queues:
            self._queues.move_to_end(key)  # every other request's item comes first
        return [it for it in batch if it.future.set_running_or_notify_cancel()]

    def _serve(self) -> None:
        while (batch := self._next_batch()) is not None:
            # the batch's log lines carry its requests' ids (one id for a batch of one request's items)
            request_id_var.set(",".join(dict.fromkeys(it.key for it in batch)))
            start = time.perf_counter()
            self._number(batch)
            done: dict[str, Any] | None = None
            failure: BaseException = RuntimeError("the batch returned nothing")
            try:
                done = self._run([it.job for it in batch])
            except BaseException as exc:  # noqa: BLE001 - the callers get it; the thread goes on
                failure = exc
            self.num_batches += 1
            if self.on_batch is not None:  # before any caller hears: its metrics include the batch it was in
                self.on_batch(BatchStats(len(batch), sum(it.cost for it in batch),
                                         [start - it.queued for it in batch], time.perf_counter() - start))
            if done is not None:
                self._finish(batch, done)
            elif len(batch) == 1:
                self._fail(batch[0], failure)
            else:
                logger.warning("a batch of %d items failed (%s: %s); running each alone", len(batch),
                               type(failure).__name__, failure)
                self._one_by_one(batch)

    def _number(self, batch: list[_Item]) -> None:
        batch_id = next(self._batch_ids)
        for it in batch:
            it.batch = (batch_id, len(batch))

    def _one_by_one(self, batch: list[_Item]) -> None:
        for it in batch:
            self._number([it])
            try:
                self._finish([it], self._run([it.job]))
            except BaseException as exc:  # noqa: BLE001
                self._fail(it, exc)

    def _fail(self, it: _Item, exc: BaseException) -> None:
        if self.on_failed is not None:
            self.on_failed([it.job.mm_hash])
        it.future.set_exception(exc)

    def _finish(self, batch: list[_Item], done: dict[str, Any]) -> None:
        for it in batch:
            out = done.get(it.job.mm_hash)
            if out is None:
                self._fail(it, RuntimeError(f"item {it.job.mm_hash} was not encoded"))
            else:
                it.future.set_result(out)


def video_job_cost(job: VideoJob, tokens_per_frame: Callable[[tuple[int, int]], int]) -> int:
    """A video part's vision tokens: its frames' (each frame counted as an image of its size)."""
    return sum(tokens_per_frame(f.size) for f in job.clip.frames)
