"""Pieces every HTTP service shares: request ids, /metrics, body limits, and running uvicorn."""
from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import h11
import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from epd_common.errors import APIError
from epd_common.logs import request_id_var

REQUEST_ID_HEADER = "X-Request-Id"
T = TypeVar("T")
logger = logging.getLogger("epd.http")


@dataclass(frozen=True, kw_only=True)
class HttpLimits:
    """What one HTTP server lets a client hold: body bytes and time, header bytes and time, connections.

    Every service's config inherits these fields (one declaration; `epd_common.cli.add_http_flags` makes the flags)
    and calls `super().__post_init__()` last."""

    max_body_bytes: int = 64 << 20  # request body, counted as received (chunked or not); 413 above
    body_read_timeout: float = 60.0  # seconds to receive a whole request body; 408 after
    header_timeout: float = 10.0  # seconds from a connection's first byte (or its opening) to a request's last header
    limit_concurrency: int = 2048  # connections + requests in progress; uvicorn answers 503 beyond (0: no limit)
    timeout_keep_alive: int = 5  # seconds an idle keep-alive connection is kept
    max_header_bytes: int = 16 << 10  # request line + headers: 431 above (400 when they arrive in pieces)
    backlog: int = 2048  # connections the kernel queues before accept
    send_timeout: float = 60.0  # seconds a response may wait on a client that reads nothing; then it is dropped

    def __post_init__(self) -> None:
        assert self.max_body_bytes > 0 and self.max_header_bytes > 0 and self.backlog > 0, "limits must be > 0"
        assert self.body_read_timeout > 0 and self.header_timeout > 0 and self.timeout_keep_alive > 0
        assert self.send_timeout > 0, "send_timeout must be > 0"
        assert self.limit_concurrency >= 0, "limit_concurrency must be >= 0 (0: no limit)"

    @classmethod
    def of(cls, cfg: object) -> HttpLimits:
        """The limits named by a service config's fields of the same names (missing ones keep the default)."""
        names = cls.__dataclass_fields__
        return cls(**{n: getattr(cfg, n) for n in names if hasattr(cfg, n)})


class _RequestId:
    """Pure ASGI (no per-request task or memory streams, unlike `@app.middleware`): take the caller's
    X-Request-Id (or make one), expose it to logs for the whole request, echo it on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = (Headers(scope=scope).get(REQUEST_ID_HEADER) or f"req-{uuid.uuid4().hex[:16]}")[:128]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        token = request_id_var.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


def install_request_id(app: FastAPI) -> None:
    """Request ids on every request (install last: the outermost layer runs first)."""
    app.add_middleware(_RequestId)


class _BodyRefused(Exception):
    """Raised to the app by a guarded receive once its body is refused (too large or too slow)."""


class _BodyGuard:
    """Counts the body bytes `receive` hands the app, and the time it takes; refuses past either limit.

    Once refused, the app gets `http.disconnect` (nothing more is read), and what it sends is dropped: the
    middleware answers with `error` instead.
    """

    def __init__(self, receive: Receive, max_bytes: int, timeout: float) -> None:
        self.inner, self.max_bytes, self.timeout = receive, max_bytes, timeout
        self.deadline = time.monotonic() + timeout
        self.num_bytes, self.done = 0, False
        self.error: APIError | None = None

    async def receive(self) -> Message:
        if self.error is not None:
            return {"type": "http.disconnect"}
        if self.done:  # the body is in: only a disconnect (or nothing) comes now, and it may take any time
            return await self.inner()
        try:
            message = await asyncio.wait_for(self.inner(), max(0.0, self.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return self._refuse(APIError(408, f"request body not received within {self.timeout:g} s",
                                         code="body_read_timeout"))
        if message["type"] == "http.request":
            self.num_bytes += len(message.get("body", b""))
            if self.num_bytes > self.max_bytes:
                return self._refuse(_too_large(self.max_bytes))
            self.done = not message.get("more_body", False)
        return message

    def _refuse(self, error: APIError) -> Message:
        self.error = error
        logger.warning("request body refused after %d bytes: %s", self.num_bytes, error.message)
        return {"type": "http.disconnect"}


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"request body is larger than {max_bytes} bytes", code="body_too_large")


def closing_response(error: APIError) -> ASGIApp:
    """The error's response with `Connection: close`: the rest of an unread body is never read."""
    response = error.response()
    response.headers["connection"] = "close"
    return response


class BodyLimit:
    """Pure ASGI: the request body is capped on the bytes actually received (chunked or not) and must arrive
    within a deadline; a declared Content-Length over the cap is refused before anything is read."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await closing_response(_too_large(self.max_bytes))(scope, receive, send)
        guard = _BodyGuard(receive, self.max_bytes, self.timeout)
        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if guard.error is None:
                started = started or message["type"] == "http.response.start"
                await send(message)

        try:
            await self.app(scope, guard.receive, guarded_send)
        except Exception:
            if guard.error is None:
                raise
        if guard.error is not None and not started:
            await closing_response(guard.error)(scope, guard.receive, send)


def install_body_limit(app: FastAPI, max_bytes: int, timeout: float) -> None:
    """Cap every request body at `max_bytes` received (413) and `timeout` seconds to receive it (408)."""
    app.add_middleware(BodyLimit, max_bytes=max_bytes, timeout=timeout)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
    """Run `work` until it ends or the client goes away: then it is cancelled (its `finally` blocks run, e.g.
    closing an upstream stream) and None is returned. Call once the request body has been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # wait for its cleanup
    return None if task.cancelled() else task.result()


def install_metrics(app: FastAPI, registry: CollectorRegistry) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def has_bearer(headers: Headers, key: str) -> bool:
    """Whether the request carries `Authorization: Bearer <key>` (constant-time compare)."""
    return hmac.compare_digest(headers.get("authorization", "").encode(), f"Bearer {key}".encode())


class _BearerKey:
    """Pure ASGI: a 401 OpenAI error on paths under `prefixes` without `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, key: str, prefixes: tuple[str, ...], what: str) -> None:
        self.app, self.key, self.prefixes, self.what = app, key, prefixes, what

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes) \
                and not has_bearer(Headers(scope=scope), self.key):
            response = APIError(401, f"missing or invalid {self.what}: send `Authorization: Bearer <key>`",
                                code="invalid_api_key").response()
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def install_api_key(app: FastAPI, key: str | None, prefixes: tuple[str, ...] = ("/v1/",),
                    what: str = "API key") -> None:
    """Require `Authorization: Bearer <key>` on paths under `prefixes` (a 401 OpenAI error otherwise); no key: open."""
    if key:
        app.add_middleware(_BearerKey, key=key, prefixes=prefixes, what=what)


def freeze_startup_heap() -> None:
    """Hide everything loaded at startup from the cyclic GC.

    A full collection scans every object the model and libraries created (measured: 210 ms for the small
    bench LM) and holds the GIL meanwhile, stalling the engine and serving threads; after this it has
    only the request-time objects to scan (measured: under 0.01 ms).
    """
    gc.collect()
    gc.freeze()


class _DeadlinesH11(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for a request's headers, and one for a client that reads nothing.

    uvicorn (0.54) has no such timer: its keep-alive timer runs only after a response and is cancelled by
    the first byte received, so a client that opens a connection and sends nothing, or sends its headers one
    byte every few seconds (slowloris), holds the connection forever. Here the clock starts when the
    connection opens, or at the first byte of the next request on a kept-alive one, and stops when the
    request's headers are complete; at `header_timeout` the connection is closed.

    A client that stops reading (its receive window full) pauses our writes; a response then waits in
    `drain()` forever, holding its generation (the proxy) or its stream (a worker). If writing stays paused
    for `send_timeout`, the connection is aborted (not closed: close() would wait to flush to a client that
    never reads): the app sees a disconnect, which stops the generation like any client that went away.
    """

    header_timeout = 10.0
    max_header_bytes = 16 << 10
    send_timeout = 60.0
    _header_timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = _HeaderCap(self.app, self.max_header_bytes)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # bytes of a request whose headers are not complete yet
            self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._disarm_send_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_timeout_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send_timer()

    def _disarm_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timeout_expired(self) -> None:
        self._send_timer = None
        if not self.transport.is_closing():
            logger.warning("dropping a connection from %s: it read nothing for %g s", self.client, self.send_timeout)
            self.transport.abort()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            logger.warning("closing a connection from %s: no complete request headers within %g s",
                           self.client, self.header_timeout)
            self.transport.close()


class _HeaderCap:
    """Pure ASGI: a 431 for a request line + headers over the cap. h11's own cap (max incomplete event size)
    only counts headers still incomplete in its buffer, so a request whose headers arrive in one read (up to
    asyncio's 256 KiB) passes it; this counts them whole."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope["raw_path"]) + len(scope["query_string"]) + sum(
                len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.max_bytes:
                error = APIError(431, f"request headers are larger than {self.max_bytes} bytes",
                                 code="headers_too_large")
                return await closing_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


def http_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """The h11 protocol class with these deadlines and header cap (uvicorn takes a class, not an instance)."""
    return type("DeadlinesH11", (_DeadlinesH11,), {"header_timeout": limits.header_timeout,
                                                   "max_header_bytes": limits.max_header_bytes,
                                                   "send_timeout": limits.send_timeout})


def uvicorn_config(app: ASGIApp, host: str, port: int, log_level: str = "info",
                   limits: HttpLimits | None = None) -> uvicorn.Config:
    """uvicorn's config with the server-side limits (connections, keep-alive, header size and time, backlog)."""
    lim = limits or HttpLimits()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30,
                          access_log=False, http=http_protocol(lim),
                          limit_concurrency=lim.limit_concurrency or None, timeout_keep_alive=lim.timeout_keep_alive,
                          h11_max_incomplete_event_size=lim.max_header_bytes, backlog=lim.backlog)


def serve(app: FastAPI, host: str, port: int, log_level: str = "info", limits: HttpLimits | None = None) -> None:
    """Run uvicorn until SIGINT/SIGTERM; in-flight requests finish (bounded) before exit."""
    uvicorn.Server(uvicorn_config(app, host, port, log_level, limits)).run()
