"""A generation's decoder events as the client's answer: an SSE stream, or one collected chat completion."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from epd_common.errors import APIError
from epd_common.logs import request_id_var
from epd_contracts.generate import Event
from proxy.generation import Generation
from proxy.metrics import ProxyMetrics
from proxy.openai_format import Completion, openai_finish_reason, openai_usage, sse

logger = logging.getLogger("epd.proxy")


async def sse_stream(gen: Generation, completion: Completion, include_usage: bool, metrics: ProxyMetrics,
               start: float) -> AsyncIterator[bytes]:
    request_id_var.set(gen.request_id)
    last, finished, failure = start, False, "generation ended without finishing"
    try:
        yield sse(completion.chunk({"role": "assistant", "content": ""}))
        async for ev in events_apart(gen):
            if ev.type == "delta":
                now = time.perf_counter()
                (metrics.itl if last > start else metrics.ttft).observe(now - last)
                last = now
                yield sse(completion.chunk({"content": ev.text}))
            elif ev.type == "done":
                finished = True
                yield sse(completion.chunk({}, openai_finish_reason(ev.finish_reason)))
                if include_usage:
                    yield sse(completion.usage_chunk(openai_usage(ev.usage)))
                break
            else:
                failure = ev.message or failure
                break
        if not finished:  # never a silent truncation
            logger.warning("stream failed: %s", failure)
            yield sse(APIError(502, failure, code="stream_interrupted").body())
        yield sse("[DONE]")
        metrics.e2e.observe(time.perf_counter() - start)
    except BaseException:  # cut off (the client left): closed from a plain task, see events_apart
        _detach(gen.close())
        raise
    await gen.close()


async def collect_response(gen: Generation, completion: Completion, metrics: ProxyMetrics,
                           start: float) -> dict[str, Any]:
    text: list[str] = []
    try:
        async for ev in gen.events():
            if ev.type == "delta":
                if not text:
                    metrics.ttft.observe(time.perf_counter() - start)
                text.append(ev.text)
            elif ev.type == "done":
                metrics.e2e.observe(time.perf_counter() - start)
                return completion.response("".join(text), openai_finish_reason(ev.finish_reason),
                                           openai_usage(ev.usage))
            else:
                raise APIError(502, ev.message or "generation failed", code="generation_failed")
        raise APIError(502, "generation ended without finishing", code="stream_interrupted")
    finally:
        await gen.close()


_DETACHED: set[asyncio.Future[Any]] = set()  # clean-ups that outlive the request's task


def _detach(work: Awaitable[Any]) -> None:
    task = asyncio.ensure_future(work)
    _DETACHED.add(task)
    task.add_done_callback(_DETACHED.discard)


_END = object()  # the decoder's events are over


async def events_apart(gen: Generation) -> AsyncIterator[Event]:
    """gen.events(), read from the decoder by a task of its own and handed over through a short queue.

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
        while (item := await queue.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        if not reader.done():
            reader.cancel()
            _detach(asyncio.gather(reader, return_exceptions=True))  # keep it referenced until it has closed
