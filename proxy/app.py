"""The OpenAI-compatible front door: /v1/chat/completions, /v1/models, /health, /metrics."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd_common.errors import APIError, install_error_handlers
from epd_common.http import (
    BodyLimit,
    has_bearer,
    install_api_key,
    install_metrics,
    install_request_id,
    until_disconnected,
)
from epd_common.logs import request_id_var
from proxy.config import ProxyConfig
from proxy.fetch_slots import FetchSlots
from proxy.fleet import Fleet
from proxy.generation import Generation
from proxy.media import has_remote_images
from proxy.metrics import ProxyMetrics
from proxy.openai_format import Completion, openai_finish_reason, openai_usage, sse
from proxy.prepare import PreparedChat, prepare_chat
from proxy.protocol import ChatCompletionRequest, InstanceRequest
from proxy.signals import Interrupted, unless_signalled
from proxy.workers import ModelMismatch

logger = logging.getLogger("epd.proxy")


async def _sse(gen: Generation, completion: Completion, include_usage: bool, metrics: ProxyMetrics,
               start: float) -> AsyncIterator[bytes]:
    request_id_var.set(gen.request_id)
    last, finished, failure = start, False, "generation ended without finishing"
    try:
        yield sse(completion.chunk({"role": "assistant", "content": ""}))
        async for ev in _events_apart(gen):
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
    except BaseException:  # cut off (the client left): closed from a plain task, see _events_apart
        _detach(gen.close())
        raise
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


_DETACHED: set[asyncio.Future[Any]] = set()  # clean-ups that outlive the request's task


def _detach(work: Awaitable[Any]) -> None:
    task = asyncio.ensure_future(work)
    _DETACHED.add(task)
    task.add_done_callback(_DETACHED.discard)


_END = object()  # the decoder's events are over


async def _events_apart(gen: Generation) -> AsyncIterator[dict[str, Any]]:
    """gen.events(), read from the decoder by a task of its own and handed over through a short queue.

    NOTE: Starlette stops a stream whose client left by cancelling an anyio scope, which cancels every await
    of the streaming task again and again, shields included; httpx's clean-up of a read cut off that way is
    itself cancelled and leaves the decoder connection open, so the sequence ran on to max_tokens (measured).
    The reading task is cancelled once, and closes the connection, which cancels the sequence; the stream's
    own close must then also run outside the cancelled task (_sse). One task per stream, not per event: a
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


class _LimitsAndCounts:
    """Pure ASGI: the body limits (epd_common/http.py BodyLimit: 413 past the bytes received, chunked or not,
    408 past the read deadline); chat completions counted by status, those refusals included."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_read_timeout: float, requests: Counter) -> None:
        self.app, self.requests = BodyLimit(app, max_body_bytes, body_read_timeout), requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
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
            try:
                await unless_signalled(fleet.start())  # SIGTERM / Ctrl-C while waiting for workers: stop
            except Interrupted as exc:
                logger.warning("%s while waiting for workers: stopping", exc)
                await fleet.close()
                yield  # uvicorn saw the signal too: it stops without serving
                return
            except BaseException:
                await fleet.close()
                raise
            state["fleet"] = fleet
            logger.info("proxy ready: %d encoder(s), %d decoder(s)", len(cfg.encode_urls), len(cfg.decode_urls))
            if on_ready is not None:
                on_ready()
            yield
            await fleet.close()
            fetch_slots.close()  # downloads still running are not waited for

    app = FastAPI(title="EPD proxy", lifespan=lifespan)
    install_error_handlers(app)
    install_metrics(app, registry)

    install_api_key(app, cfg.api_key)  # inside the counting middleware: 401s are counted too

    app.add_middleware(_LimitsAndCounts, max_body_bytes=cfg.max_body_bytes, body_read_timeout=cfg.body_read_timeout,
                       requests=metrics.requests)
    fetch_slots = FetchSlots(cfg.max_concurrent_fetches)  # image downloads at once, all requests together

    install_request_id(app)  # outermost: the id is set before anything else runs

    async def prepare(req: ChatCompletionRequest) -> PreparedChat:
        """Text alone is cheap: no thread hop. Images are loaded within --media-fetch-deadline: downloads on a
        fetch slot (threads of their own, a cap shared by all requests), data and file images on asyncio's pool."""
        if not req.num_images():
            return prepare_chat(req, cfg)
        deadline = time.monotonic() + cfg.media_fetch_deadline
        if has_remote_images(req):
            return await fetch_slots.run(deadline, prepare_chat, req, cfg, deadline)
        return await asyncio.to_thread(prepare_chat, req, cfg, deadline)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        # a client that leaves before its answer is out (prepare, encode, a non-streaming generation) stops it:
        # no generation is opened, or the one opened is closed, which cancels it on the decoder
        answer = await until_disconnected(request.receive, answer_chat(req))
        if answer is None:
            logger.info("client went away before its answer: stopped")
            return Response(status_code=499)  # nobody reads it; counted in epd_proxy_requests
        return answer

    async def answer_chat(req: ChatCompletionRequest) -> Response:
        start = time.perf_counter()
        rid = request_id_var.get()
        fleet = state["fleet"]
        chat = await prepare(req)
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
        """Liveness: 200 while the process serves, whatever its workers do (readiness is /ready)."""
        if "fleet" not in state:
            raise APIError(503, "proxy is starting", code="not_ready")
        return {"status": "ok", "role": "proxy", **_instances(state["fleet"])}

    @app.get("/ready")
    async def ready() -> dict[str, Any]:
        """Readiness: 503 while no healthy decoder (or, unless aggregated, no healthy encoder) can take work."""
        why = "proxy is starting" if "fleet" not in state else \
            state["fleet"].workers.not_ready(need_encoder=not cfg.aggregated)
        if why is not None:
            raise APIError(503, f"not ready: {why}", code="not_ready")
        return {"status": "ready", "role": "proxy"}

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
        except ModelMismatch as exc:
            raise APIError(409, str(exc), param="url", code="model_mismatch") from exc
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
