"""A generation's decoder events as the client's answer: an SSE stream, or one collected completion (chat or text)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol

from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse

from epd_common.errors import APIError
from epd_common.logs import request_id_var
from epd_contracts.generate import Event
from proxy.choices import Choices
from proxy.generation import Generation
from proxy.metrics import ProxyMetrics
from proxy.openai_format import sse

logger = logging.getLogger("epd.proxy")


class Answer(Protocol):
    """How one endpoint writes its answer (chat: openai_format.Completion; text: completions.TextCompletion)."""

    def first_chunks(self, n: int) -> list[dict[str, Any]]: ...
    def delta_chunk(self, ev: Event) -> dict[str, Any] | None: ...
    def finish_chunk(self, ev: Event) -> dict[str, Any]: ...
    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]: ...
    def response(self, choices: Choices) -> dict[str, Any]: ...


class _Chunks:
    """One stream's chunks as its events come: the choices so far, the token timings, the error it ends with."""

    def __init__(self, answer: Answer, include_usage: bool, metrics: ProxyMetrics, start: float, n: int):
        self.answer, self.include_usage, self.metrics, self.start, self.last = answer, include_usage, metrics, start, start
        self.choices = Choices(n)
        self.failure = APIError(502, "generation ended without finishing", code="stream_interrupted")
        self.out = [sse(first) for first in answer.first_chunks(n)]

    def take(self, ev: Event) -> bool:
        """Add one event's chunks; True when the stream ends with it (every choice finished, or an error)."""
        if ev.type == "error":
            self.failure = event_error(ev, self.failure.message, "stream_interrupted")
            return True
        try:
            self.choices.add(ev)
        except APIError as exc:
            self.failure = APIError(502, exc.message, code="stream_interrupted")
            return True
        if ev.type == "delta":
            now = time.perf_counter()
            (self.metrics.itl if self.last > self.start else self.metrics.ttft).observe(now - self.last)
            self.last = now
            if (chunk := self.answer.delta_chunk(ev)) is not None:
                self.out.append(sse(chunk))
            return False
        self.out.append(sse(self.answer.finish_chunk(ev)))
        if not self.choices.finished:
            return False
        self.metrics.answered(self.choices.usage())
        if self.include_usage:
            self.out.append(sse(self.answer.usage_chunk(self.choices.usage())))
        return True

    def flush(self) -> bytes:
        data = b"".join(self.out)
        self.out.clear()
        return data


async def sse_stream(gen: Generation, answer: Answer, include_usage: bool, metrics: ProxyMetrics,
                     start: float, n: int = 1) -> AsyncIterator[bytes]:
    """Every choice's chunks as they come (interleaved, each with its index), each choice's finish, then the
    usage of all n (include_usage) and [DONE]; an error or a stream that ends early ends with an error event.

    The events already read from the decoder go out in one write (batches_apart): a real decoder's tokens arrive
    one by one and are each written at once, but a burst (the first chunk with the first token, as vLLM sends it;
    the last token, its finish, the usage and [DONE]; several choices' tokens) costs one pass through the ASGI
    middleware and one send instead of one per chunk."""
    request_id_var.set(gen.request_id)
    chunks = _Chunks(answer, include_usage, metrics, start, n)
    try:
        async for batch in batches_apart(gen):
            if any(chunks.take(ev) for ev in batch):  # the stream ends with this event; the rest are not read
                break
            if chunks.out:
                yield chunks.flush()
        if not chunks.choices.finished:  # never a silent truncation
            logger.warning("stream failed: %s", chunks.failure.message)
            chunks.out.append(sse(chunks.failure.body()))
        chunks.out.append(sse("[DONE]"))
        yield chunks.flush()
        metrics.e2e.observe(time.perf_counter() - start)
    except BaseException:  # cut off (the client left): closed from a plain task, see batches_apart
        _detach(gen.close())
        raise
    await gen.close()


async def collect_response(gen: Generation, answer: Answer, metrics: ProxyMetrics, start: float,
                           n: int = 1) -> dict[str, Any]:
    """The whole answer once every choice is done (`choices` in index order)."""
    choices, first = Choices(n), True
    try:
        async for ev in gen.events():
            if ev.type == "error":
                raise event_error(ev, "generation failed", "generation_failed")
            choices.add(ev)
            if ev.type == "delta" and first:
                metrics.ttft.observe(time.perf_counter() - start)
                first = False
            elif choices.finished:
                metrics.e2e.observe(time.perf_counter() - start)
                metrics.answered(choices.usage())
                return answer.response(choices)
        raise APIError(502, "generation ended without finishing", code="stream_interrupted")
    finally:
        await gen.close()


def event_error(ev: Event, default: str, code: str) -> APIError:
    """A decoder's error event as the client's error: the request's own 4xx as the decoder said (a schema whose
    output cannot be completed), anything else a 502 with `code`."""
    if ev.status is not None:
        return APIError(ev.status, ev.message or default, param=ev.param, code=ev.code)
    return APIError(502, ev.message or default, code=code)


async def respond(gen: Generation, answer: Answer, stream: bool, include_usage: bool, metrics: ProxyMetrics,
                  start: float, n: int) -> Response:
    """The answer as an SSE stream, or collected into one JSON object."""
    if stream:
        return StreamingResponse(sse_stream(gen, answer, include_usage, metrics, start, n),
                                 media_type="text/event-stream")
    return JSONResponse(await collect_response(gen, answer, metrics, start, n))


_DETACHED: set[asyncio.Future[Any]] = set()  # clean-ups that outlive the request's task


def _detach(work: Awaitable[Any]) -> None:
    task = asyncio.ensure_future(work)
    _DETACHED.add(task)
    task.add_done_callback(_DETACHED.discard)


_END = object()  # the decoder's events are over


async def batches_apart(gen: Generation) -> AsyncIterator[list[Event]]:
    """gen.events(), read from the decoder by a task of its own and handed over through a short queue; each batch
    is every event read by the time the stream asks (never empty; one event when the stream keeps up).

    NOTE: Starlette stops a stream whose client left by cancelling an anyio scope, which cancels every await
    of the streaming task again and again, shields included; httpx's clean-up of a read cut off that way is
    itself cancelled and leaves the decoder connection open, so the sequence ran on to max_tokens (measured).
    The reading task is cancelled once, and closes the connection, which cancels the sequence; the stream's
    own close must then also run outside the cancelled task (sse_stream). One task per stream, not per event: a
    queue hand-over costs a few microseconds an event, a task per event measured ~25 us.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=16)  # bounded: a slow client slows the reading

    async def pump() -> None:
        try:
            async for ev in gen.events():
                await queue.put(ev)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, raised there
            await queue.put(exc)
            return
        await queue.put(_END)

    reader = asyncio.ensure_future(pump())
    try:
        while True:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            last = items[-1]  # the end or an error is always the pump's last item
            ended = last is _END or isinstance(last, Exception)
            if batch := items[:-1] if ended else items:
                yield batch
            if isinstance(last, Exception):
                raise last
            if ended:
                return
    finally:
        if not reader.done():
            reader.cancel()
            _detach(asyncio.gather(reader, return_exceptions=True))  # keep it referenced until it has closed
