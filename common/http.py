"""Pieces every HTTP service shares: request ids, /metrics, and running uvicorn."""
from __future__ import annotations

import gc
import hmac
import uuid

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import APIError
from common.logs import request_id_var

REQUEST_ID_HEADER = "X-Request-Id"


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


def serve(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Run uvicorn until SIGINT/SIGTERM; in-flight requests finish (bounded) before exit."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30,
                            access_log=False)
    uvicorn.Server(config).run()
