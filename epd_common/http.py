"""ASGI pieces every HTTP service shares: request ids, /metrics, body limits, API keys, client disconnects.

Running uvicorn with the server-side limits is `epd_common/server.py`."""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd_common.errors import APIError
from epd_common.logs import request_id_var

REQUEST_ID_HEADER = "X-Request-Id"
T = TypeVar("T")
logger = logging.getLogger("epd.http")


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
            async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):  # no task per read, as wait_for
                message = await self.inner()
        except TimeoutError:
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
    closing an upstream stream) and None is returned. Call once the request body has been read.

    `work` runs in the caller's task; a watcher task cancels that task when the client leaves, and the cancellation
    is taken back here (Task.uncancel), so a cancellation from elsewhere (shutdown) still propagates. One task per
    request instead of two and an asyncio.wait: the proxy's route starts one loop turn sooner and ends one sooner.
    """
    me = asyncio.current_task()
    assert me is not None, "until_disconnected runs in a task"
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(receive)
        gone = True
        me.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and me.uncancel() == 0:  # only the watcher cancelled us: the client left
            return None
        raise
    finally:
        watcher.cancel()


def install_metrics(app: FastAPI, registry: CollectorRegistry) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def has_bearer(headers: Headers, key: str) -> bool:
    """Whether the request carries `Authorization: Bearer <key>`: the scheme in any case (RFC 7235 schemes are
    case-insensitive), the key compared in constant time."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    # NOTE: the compare runs whatever the scheme, so a wrong scheme takes as long as a wrong key
    matches = hmac.compare_digest(token.strip(" ").encode(), key.encode())
    return matches and scheme.lower() == "bearer"


def is_internal(headers: Headers, key: str | None) -> bool:
    """Whether a request carries the internal key; never when none is set (a /health's details need it)."""
    if not key:
        return False
    return has_bearer(headers, key)


def internal_pid(headers: Headers, key: str | None) -> dict[str, int]:
    """{"pid": this process's id} for a /health caller with the internal key (the fleet's own tools), else {}:
    an open probe learns nothing about the host's processes."""
    return {"pid": os.getpid()} if is_internal(headers, key) else {}


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
