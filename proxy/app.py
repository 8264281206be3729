"""The OpenAI-compatible front door: /v1/chat/completions, /v1/models, /health, /metrics."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import APIError, install_error_handlers
from common.http import has_bearer, install_api_key, install_metrics, install_request_id
from common.logs import request_id_var
from proxy.config import ProxyConfig
from proxy.fleet import Fleet
from proxy.generation import Generation
from proxy.metrics import ProxyMetrics
from proxy.openai_format import Completion, openai_finish_reason, openai_usage, sse
from proxy.prepare import prepare_chat
from proxy.protocol import ChatCompletionRequest, InstanceRequest

logger = logging.getLogger("epd.proxy")


async def _sse(gen: Generation, completion: Completion, include_usage: bool, metrics: ProxyMetrics,
               start: float) -> AsyncIterator[bytes]:
    request_id_var.set(gen.request_id)
    last, finished, failure = start, False, "generation ended without finishing"
    try:
        yield sse(completion.chunk({"role": "assistant", "content": ""}))
        async for ev in gen.events():
            if ev["type"] == "delta":
                now = time.perf_counter()
                (metrics.itl if last > start else metrics.ttft).observe(now - last)
                last = now
                yield sse(completion.chunk({"content": ev["text"]}))
            elif ev["type"] == "done":
                finished = True
                yield sse(completion.chunk({}, openai_finish_reason(ev.get("finish_reason"))))
                if include_usage:
                    yield sse(completion.usage_chunk(openai_usage(ev["usage"])))
                break
            else:
                failure = str(ev.get("message", failure))
                break
        if not finished:  # never a silent truncation
            logger.warning("stream failed: %s", failure)
            yield sse(APIError(502, failure, code="stream_interrupted").body())
        yield sse("[DONE]")
        metrics.e2e.observe(time.perf_counter() - start)
    finally:
        await gen.close()


async def _collect(gen: Generation, completion: Completion, metrics: ProxyMetrics, start: float) -> dict[str, Any]:
    text: list[str] = []
    try:
        async for ev in gen.events():
            if ev["type"] == "delta":
                if not text:
                    metrics.ttft.observe(time.perf_counter() - start)
                text.append(ev["text"])
            elif ev["type"] == "done":
                metrics.e2e.observe(time.perf_counter() - start)
                return completion.response("".join(text), openai_finish_reason(ev.get("finish_reason")),
                                           openai_usage(ev["usage"]))
            else:
                raise APIError(502, str(ev.get("message", "generation failed")), code="generation_failed")
        raise APIError(502, "generation ended without finishing", code="stream_interrupted")
    finally:
        await gen.close()


class _LimitsAndCounts:
    """Pure ASGI: a 413 for a declared body over the limit (before it is read); chat completions counted
    by status."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, requests: Counter) -> None:
        self.app, self.max_body_bytes, self.requests = app, max_body_bytes, requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = scope["path"] == "/v1/chat/completions"
        size = Headers(scope=scope).get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            if counted:
                self.requests.labels("413").inc()
            response = APIError(413, f"request body is larger than {self.max_body_bytes} bytes",
                                code="body_too_large").response()
            return await response(scope, receive, send)
        if not counted:
            return await self.app(scope, receive, send)

        async def count(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.requests.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, count)


def _instances(fleet: Fleet) -> dict[str, Any]:
    return {f"{role}s": [w.describe() for w in fleet.workers.of(role)] for role in ("encoder", "decoder")}


def create_app(cfg: ProxyConfig, on_ready: Callable[[], None] | None = None) -> FastAPI:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    state: dict[str, Fleet] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits, timeout=cfg.worker_timeout) as client:
            fleet = Fleet(cfg, client, metrics)
            await fleet.start()
            state["fleet"] = fleet
            logger.info("proxy ready: %d encoder(s), %d decoder(s)", len(cfg.encode_urls), len(cfg.decode_urls))
            if on_ready is not None:
                on_ready()
            yield
            await fleet.close()

    app = FastAPI(title="EPD proxy", lifespan=lifespan)
    install_error_handlers(app)
    install_metrics(app, registry)

    install_api_key(app, cfg.api_key)  # inside the counting middleware: 401s are counted too

    app.add_middleware(_LimitsAndCounts, max_body_bytes=cfg.max_body_bytes, requests=metrics.requests)

    install_request_id(app)  # outermost: the id is set before anything else runs

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest) -> Response:
        start = time.perf_counter()
        rid = request_id_var.get()
        fleet = state["fleet"]
        # images may be downloaded or decoded: off the event loop; text alone is cheap: no thread hop
        chat = await asyncio.to_thread(prepare_chat, req, cfg) if req.num_images() else prepare_chat(req, cfg)
        gen = Generation(fleet, chat, rid)
        try:
            if cfg.pipeline_encode and not cfg.aggregated:
                await gen.open_pipelined()
            else:
                await gen.open(await fleet.encode(chat.items, rid))
        except BaseException:
            await gen.close()
            raise
        completion = Completion(model=cfg.served_model_name)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(gen, completion, include_usage, metrics, start),
                                     media_type="text/event-stream")
        return JSONResponse(await _collect(gen, completion, metrics, start))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": cfg.served_model_name, "object": "model", "created": 0, "owned_by": "epd"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if "fleet" not in state:
            raise APIError(503, "proxy is starting", code="not_ready")
        return {"status": "ok", "role": "proxy", **_instances(state["fleet"])}

    def require_internal_key(request: Request) -> Fleet:
        """/instances needs the internal key (not the public API key); without one configured it is off."""
        if not cfg.internal_key:
            raise APIError(403, "dynamic registration is off: start the proxy with --internal-key",
                           code="registration_disabled")
        if not has_bearer(request.headers, cfg.internal_key):
            raise APIError(401, "missing or invalid internal key: send `Authorization: Bearer <internal key>`",
                           code="invalid_internal_key")
        if "fleet" not in state:
            raise APIError(503, "proxy is starting", code="not_ready")
        return state["fleet"]

    @app.get("/instances")
    async def list_instances(request: Request) -> dict[str, Any]:
        return _instances(require_internal_key(request))

    @app.post("/instances", status_code=201)
    async def add_instance(body: InstanceRequest, request: Request) -> dict[str, Any]:
        fleet = require_internal_key(request)
        if cfg.aggregated and body.role == "encoder":
            raise APIError(400, "an aggregated proxy has no encoders", param="role", code="invalid_value")
        try:
            worker = await fleet.register(body.role, body.url)
        except ValueError as exc:
            raise APIError(409, str(exc), param="url", code="conflict") from exc
        return {"role": worker.role, **worker.describe()}

    @app.delete("/instances")
    async def remove_instance(body: InstanceRequest, request: Request) -> dict[str, Any]:
        worker = require_internal_key(request).deregister(body.url)
        if worker is None:
            raise APIError(404, f"no worker is registered at {body.url}", param="url", code="not_found")
        return {"role": worker.role, "url": worker.url, "removed": True}

    return app
