"""HTTP front of a decoder worker: POST /generate (NDJSON), GET /health, GET /metrics; epd-decoder."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry

from connector.tensors.consumer import ECConsumer
from decoder_service import lora_routes
from decoder_service.config import DecoderConfig
from decoder_service.engine.memory_plan import KVPlanError
from decoder_service.engine.sequence import Job
from decoder_service.engine.tp.ranks import RankStartError
from decoder_service.engine.work import Work
from decoder_service.grammar import CompiledGuide
from decoder_service.handoff import HandoffDeclined
from decoder_service.job_trace import trace_job
from decoder_service.metrics import DecoderMetrics
from decoder_service.shell import Engine
from decoder_service.startup import start_engine
from decoder_service.state import DecoderState
from decoder_service.watchdog import FatalHandler, exit_process
from epd_common.errors import APIError, bad_request, install_error_handlers
from epd_common.http import install_api_key, install_body_limit, install_metrics, install_request_id, internal_pid
from epd_common.logs import request_id_var
from epd_common.server import freeze_startup_heap
from epd_common.tracing import install_tracing, start_tracing
from epd_contracts.generate import Event, GenerateRequest
from epd_contracts.validation import ContractError, decode_json
from epd_models.halves import LanguageHalf, loaded_summary
from epd_models.lora.layers import AdaptersBusy
from epd_models.lora.peft_format import LoRAError

logger = logging.getLogger("epd.decoder")
KEEPALIVE_S = 1.0  # an empty NDJSON line after this long without an event (a stream queued for a row)
router = APIRouter()


def _state(request: Request) -> DecoderState:
    state: DecoderState = request.app.state.decoder
    return state


async def _read(request: Request) -> GenerateRequest:
    try:
        return decode_json(await request.body(), GenerateRequest)
    except ContractError as exc:
        raise bad_request(exc.message, exc.param, code="invalid_request") from None


async def _stream(job: Job, request_id: str) -> AsyncIterator[bytes]:
    """The job's events as NDJSON lines, until each of its choices is `done` (those a prefill worker did not end,
    for a continued request), or its one `error`, or its `handoff` (a prefill worker's). An empty line every
    KEEPALIVE_S while there is nothing to send (the stream waits in the queue for a row): the proxy's
    --worker-timeout is a bound on a decoder's silence, and a live decoder with a long queue is never silent."""
    request_id_var.set(request_id)
    encoder = msgspec.json.Encoder()
    resume = job.work.resume
    num_running = job.params.n if resume is None else resume.rows
    try:
        while num_running:
            try:
                event = job.events.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(KEEPALIVE_S):
                        event = await job.events.get()
                except TimeoutError:  # queued for a row, or between slow tokens: not a dead decoder
                    yield b"\n"
                    continue
            yield encoder.encode(event) + b"\n"
            if event.type in ("error", "handoff"):
                return
            num_running -= event.type == "done"
    finally:  # client gone (or done): stop the sequence at its next step
        job.cancelled.set()
        trace_job(job)


async def _set_on_disconnect(request: Request, cancelled: threading.Event) -> None:
    """Set `cancelled` when the client goes away (the body is read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancelled.set()


async def _prepare(engine: Engine, req: GenerateRequest, guide: CompiledGuide | None, watcher: asyncio.Task[None]
                   ) -> Work:
    """engine.prepare on a worker thread; while every resident LoRA slot is in use (AdaptersBusy), wait for one to
    be released and try again (the client going away ends the wait)."""
    while True:
        try:
            return await asyncio.to_thread(engine.prepare, *((req,) if guide is None else (req, guide, True)))
        except AdaptersBusy as busy:
            freed = asyncio.wrap_future(busy.freed)
            await asyncio.wait((freed, watcher), return_when=asyncio.FIRST_COMPLETED)
            if watcher.done():
                freed.cancel()
                raise APIError(503, "the client went away while its LoRA adapter waited for a slot",
                               code="overloaded") from None


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = _state(request)
    req = await _read(request)
    engine, metrics = state.ready_engine(), state.metrics
    if engine.num_waiting >= state.cfg.max_queued:
        raise APIError(503, "decoder queue is full", code="overloaded")
    metrics.waiting.inc()
    cancelled = threading.Event()  # the client went away while its embeddings were gathered
    watcher = asyncio.create_task(_set_on_disconnect(request, cancelled))
    try:  # a grammar compiles on its own pool, so a request without one never waits behind compiles
        guide = await engine.guide(req, watcher)
        work = await _prepare(engine, req, guide, watcher)
        try:
            job = engine.submit(work, cancelled=cancelled)
        except BaseException:
            engine.release(work)
            raise
    except HandoffDeclined as exc:  # a short prompt: the proxy runs it on a decode worker
        metrics.requests.labels("200").inc()
        metrics.waiting.dec()
        line = msgspec.json.encode(Event(type="declined", message=str(exc))) + b"\n"
        return StreamingResponse(iter((line,)), media_type="application/x-ndjson")
    except Exception as exc:  # an APIError is this request's answer; anything else its 500 (error handlers)
        metrics.requests.labels(str(exc.status) if isinstance(exc, APIError) else "500").inc()
        metrics.waiting.dec()
        raise
    finally:
        watcher.cancel()
    metrics.requests.labels("200").inc()

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in _stream(job, request_id_var.get()):
                yield chunk
        finally:
            metrics.waiting.dec()
            engine.release(work)

    return StreamingResponse(body(), media_type="application/x-ndjson")


@router.get("/health")
@router.head("/health", include_in_schema=False)  # HEAD: the same status, no body
async def health(request: Request) -> dict[str, object]:
    state = _state(request)
    engine = state.ready_engine()
    loaded = loaded_summary(engine.lm.module)
    if engine.inline is not None:  # aggregated mode holds both halves
        vision = loaded_summary(engine.inline.vision.module)
        loaded = {"modules": sorted([*loaded["modules"], *vision["modules"]]),  # type: ignore[misc]
                  "num_parameters": loaded["num_parameters"] + vision["num_parameters"],  # type: ignore[operator]
                  "num_encoded": engine.inline.num_encoded}
    if (quant := engine.lm.quant.summary()) is not None:
        loaded["quantization"] = quant
    cfg = state.cfg
    return {"status": "ok", "role": "decoder", "model": cfg.model, "model_identity": state.identity,
            "aggregated": cfg.aggregated, "max_model_len": engine.max_model_len, "max_num_seqs": cfg.max_num_seqs,
            "waiting": engine.num_waiting, "running": engine.num_running,
            "loaded": loaded, "prefix_cache": engine.prefix_summary(),
            "decoder_role": cfg.role, "kv_address": state.handoff.address,
            "kv_cache": engine.kv_summary(), **({"kv_store": kv_store} if (kv_store := state.handoff.stats()) else {}),
            **({"spec_decode": spec} if (spec := engine.spec_summary()) is not None else {}),
            **({"loras": engine.lm.lora.describe()} if engine.lm.lora is not None else {}),
            **internal_pid(request.headers, cfg.internal_key)}


def create_app(cfg: DecoderConfig, lm: LanguageHalf | None = None, on_fatal: FatalHandler | None = None) -> FastAPI:
    """The decoder app; loads its LM at startup unless one is given (tests).

    `on_fatal(code, reason)` is called once if the engine dies or stalls (default: exit the process non-zero).
    """
    registry = CollectorRegistry()
    consumer = ECConsumer(cache_bytes=cfg.ec_cache_bytes, curve=cfg.curve, check=lambda out: state.check_embedding(out),
                          max_message_bytes=cfg.ec_max_message_bytes, max_reply_bytes=cfg.ec_max_reply_bytes,
                          max_items_per_get=cfg.ec_max_items_per_get, shm=cfg.ec_shm == "auto")
    state = DecoderState(cfg, consumer, DecoderMetrics(registry, consumer.stats))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            watchdog = await start_engine(state, lm, on_fatal or exit_process())
        except (KVPlanError, RankStartError, LoRAError) as exc:  # epd-decoder exits 2 with the line (cli.main)
            logger.critical("decoder cannot start: %s", exc)
            state.refused = str(exc)
            consumer.close()
            raise
        freeze_startup_heap()
        yield
        watchdog.stop()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.close)
            if state.engine.lm.ranks is not None and lm is None:  # the ranks this decoder started
                await asyncio.to_thread(state.engine.lm.ranks.close)
        state.handoff.close()
        consumer.close()

    app = FastAPI(title="EPD decoder", lifespan=lifespan)
    app.state.decoder = state
    install_error_handlers(app)
    start_tracing("epd-decoder", cfg)
    install_tracing(app, ("/generate",))
    install_request_id(app)
    install_metrics(app, registry)
    install_body_limit(app, cfg.max_body_bytes, cfg.body_read_timeout)  # bytes received, chunked or not
    install_api_key(app, cfg.internal_key, ("/generate", *lora_routes.PATHS), "internal key")
    app.include_router(router)
    app.include_router(lora_routes.router)
    return app
