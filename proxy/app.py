"""The OpenAI-compatible front door: /v1/chat/completions, /v1/models, /health, /metrics."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry

from common.errors import APIError, install_error_handlers
from common.http import install_api_key, install_metrics, install_request_id
from common.logs import request_id_var
from proxy.config import ProxyConfig
from proxy.fleet import Fleet
from proxy.metrics import ProxyMetrics
from proxy.openai_format import Completion, openai_finish_reason, openai_usage, sse
from proxy.prepare import PreparedChat, prepare_chat
from proxy.protocol import ChatCompletionRequest
from scheduler.scheduler import MMItem

logger = logging.getLogger("epd.proxy")


class Generation:
    """One request's upstream generation: opened with recovery, read as events, released once."""

    def __init__(self, fleet: Fleet, chat: PreparedChat, request_id: str):
        self.fleet, self.chat, self.request_id = fleet, chat, request_id
        self.decoder = fleet.acquire_decoder()
        self.resp: httpx.Response | None = None

    async def open(self, sources: dict[str, str], pending: frozenset[str] = frozenset()) -> None:
        """Open the decoder stream; a gather miss re-encodes the missing items and retries once.

        `pending` items are still being encoded: the decoder's gather waits for them (pipelined mode).
        """
        for attempt in (0, 1):
            images = [self._image(it, sources, pending) for it in self.chat.items]
            payload = {"messages": self.chat.messages, **self.chat.sampling, "images": images}
            try:
                self.resp = await self.fleet.open_generation(self.decoder, payload, self.request_id)
                return
            except APIError as exc:
                if exc.code != "missing_embeddings":
                    raise
                if attempt:  # lost again right after re-encoding: not the client's fault, and retryable
                    raise APIError(503, f"embeddings lost twice: {exc.message}", code="embeddings_unavailable") from exc
                self.fleet.metrics.retries.inc()
                missing = set(exc.extra.get("missing", []))
                logger.warning("decoder missed %d embedding(s); re-encoding", len(missing))
                redo = [it for it in self.chat.items if it.mm_hash in missing]
                sources = {**sources, **await self.fleet.encode(redo, self.request_id, skip_cached=False)}
                pending = frozenset()

    async def open_pipelined(self) -> None:
        """Schedule the encodes, then open the decoder stream while they run; an encode error wins."""
        out = await self.fleet.schedule(self.chat.items)
        pending = frozenset(it.mm_hash for todo in out.scheduled_encoder_inputs.values() for it in todo)
        encodes = asyncio.create_task(self.fleet.run_encodes(out, self.request_id))
        opening = asyncio.create_task(self.open(out.sources, pending))
        try:
            await encodes
        except BaseException:
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
            raise
        await opening

    def _image(self, item: MMItem, sources: dict[str, str], pending: frozenset[str]) -> dict[str, Any]:
        if self.fleet.cfg.aggregated:  # the decoder encodes it: send the bytes
            return {"mm_hash": item.mm_hash, "data": base64.b64encode(item.data).decode()}
        return {"mm_hash": item.mm_hash, "source": sources[item.mm_hash], "pending": item.mm_hash in pending}

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        assert self.resp is not None
        try:
            async for line in self.resp.aiter_lines():
                if line:
                    yield json.loads(line)
        except httpx.HTTPError as exc:
            yield {"type": "error", "message": f"decoder connection lost: {type(exc).__name__}"}

    async def close(self) -> None:
        if self.resp is not None:
            await self.resp.aclose()
        if self.decoder >= 0:
            self.fleet.release_decoder(self.decoder)
            self.decoder = -1


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
            fleet.close()

    app = FastAPI(title="EPD proxy", lifespan=lifespan)
    install_error_handlers(app)
    install_metrics(app, registry)

    install_api_key(app, cfg.api_key)  # inside the counting middleware: 401s are counted too

    @app.middleware("http")
    async def _limits_and_counts(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > cfg.max_body_bytes:
            response: Response = APIError(413, f"request body is larger than {cfg.max_body_bytes} bytes",
                                          code="body_too_large").response()
        else:
            response = await call_next(request)
        if request.url.path == "/v1/chat/completions":
            metrics.requests.labels(str(response.status_code)).inc()
        return response

    install_request_id(app)  # outermost: the id is set before anything else runs

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest) -> Response:
        start = time.perf_counter()
        rid = request_id_var.get()
        fleet = state["fleet"]
        chat = await asyncio.to_thread(prepare_chat, req, cfg)
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
        return {"status": "ok", "role": "proxy", "encoders": list(cfg.encode_urls), "decoders": list(cfg.decode_urls)}

    return app
