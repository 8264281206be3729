"""HTTP front of an encoder worker: POST /encode, GET /health, GET /metrics; console script epd-encoder."""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextvars
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgspec
from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CollectorRegistry

from connector.tensors.producer import ECProducer
from encoder_service.config import EncoderConfig
from encoder_service.fair_queue import FairExecutor
from encoder_service.metrics import EncoderMetrics
from encoder_service.worker import EncoderWorker, ScheduledEncoderInput
from epd_common.errors import APIError, bad_request, install_error_handlers
from epd_common.http import install_api_key, install_body_limit, install_metrics, install_request_id
from epd_common.images import ImageError
from epd_common.logs import request_id_var
from epd_common.server import freeze_startup_heap
from epd_contracts.encode import EncodedItem, EncodeRequest, EncodeResponse
from epd_contracts.hashing import mm_hash
from epd_contracts.validation import ContractError, decode_json
from epd_contracts.video import part_hash
from epd_models.encode import UndecodableVideo
from epd_models.halves import VisionHalf, loaded_summary
from epd_models.identity import model_identity
from epd_models.resolve import resolve_model
from epd_models.video_config import video_limits

logger = logging.getLogger("epd.encoder")
router = APIRouter()


@dataclass
class EncoderState:
    """Everything the routes share (`app.state.encoder`); the worker and its metrics exist once it is built."""

    cfg: EncoderConfig
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    # the one encode thread, its calls taken round-robin by request id (encoder_service/fair_queue.py)
    executor: FairExecutor = field(default_factory=FairExecutor)
    worker: EncoderWorker | None = None
    metrics: EncoderMetrics | None = None
    identity: dict[str, object] = field(default_factory=dict)

    def ready(self) -> tuple[EncoderWorker, EncoderMetrics]:
        """The worker and its metrics, or a 503 while it is built."""
        if self.worker is None or self.metrics is None:
            raise APIError(503, "encoder is loading", code="not_ready")
        return self.worker, self.metrics


def _state(request: Request) -> EncoderState:
    state: EncoderState = request.app.state.encoder
    return state


def _check_caps(req: EncodeRequest, cfg: EncoderConfig) -> None:
    """Item count (400) and decoded bytes (413, judged from the base64 lengths before anything is decoded)."""
    if len(req.items) > cfg.max_items_per_request:
        raise bad_request(f"{len(req.items)} items in one /encode, over the limit of {cfg.max_items_per_request}",
                          param="items", code="too_many_items")
    decoded = sum(len(item.data) for item in req.items) * 3 // 4
    if decoded > cfg.max_encode_bytes + 2 * len(req.items):  # base64 padding: up to 2 bytes per item
        raise APIError(413, f"the images of one /encode decode to about {decoded} bytes, over the limit of "
                            f"{cfg.max_encode_bytes}", param="items", code="request_too_large")


def _decode_items(req: EncodeRequest) -> list[ScheduledEncoderInput]:
    """Decode each item and hash its bytes here: a caller never chooses the hash an embedding is stored under."""
    out = []
    for i, item in enumerate(req.items):
        try:
            data = base64.b64decode(item.data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise bad_request(f"items[{i}].data is not valid base64: {exc}", param=f"items.{i}.data") from exc
        if item.video is not None and (item.detail != "auto" or item.multi_image):
            raise bad_request(f"items[{i}] is a video: detail and multi_image are for images",
                              param=f"items.{i}.video")
        computed = mm_hash(data, item.detail, item.multi_image) if item.video is None else part_hash(data, item.video)
        if item.mm_hash is not None and item.mm_hash != computed:
            raise bad_request(f"items[{i}].mm_hash does not match the hash of its bytes (epd_contracts.hashing, "
                              "epd_contracts.video for a video)", param=f"items.{i}.mm_hash", code="hash_mismatch")
        out.append(ScheduledEncoderInput(computed, data, item.detail, item.multi_image, item.video))
    return out


def _timed(w: EncoderWorker, m: EncoderMetrics, items: list[ScheduledEncoderInput]) -> list[EncodedItem]:
    """execute_mm_encoder on the encode thread, its running time counted (the wait for the thread is not)."""
    start = time.perf_counter()
    try:
        return w.execute_mm_encoder(items)
    finally:
        m.run_seconds.inc(time.perf_counter() - start)


def build_worker(cfg: EncoderConfig) -> EncoderWorker:
    vision = VisionHalf(resolve_model(cfg.model), cfg.dtype, cfg.device)
    producer = ECProducer(bind=cfg.ec_bind, cache_bytes=cfg.ec_cache_bytes, events_bind=cfg.ec_events_bind,
                          curve=cfg.curve, advertise_host=cfg.ec_advertise_host,
                          max_items_per_get=cfg.ec_max_items_per_get, max_reply_bytes=cfg.ec_max_reply_bytes,
                          max_parked_gets=cfg.ec_max_parked_gets, max_parked_hashes=cfg.ec_max_parked_hashes,
                          shm=cfg.ec_shm == "auto").start()
    return EncoderWorker(vision, producer, cfg.max_batch_size, cfg.max_image_pixels,
                         video_limits(cfg, cfg.max_encode_bytes))


async def _read(request: Request) -> EncodeRequest:
    try:
        return decode_json(await request.body(), EncodeRequest)
    except ContractError as exc:
        raise bad_request(exc.message, exc.param, code="invalid_request") from None


@router.post("/encode")
async def encode(request: Request) -> Response:
    state = _state(request)
    req = await _read(request)
    w, m = state.ready()
    try:
        _check_caps(req, state.cfg)
        items = await asyncio.to_thread(_decode_items, req)  # base64 and sha256 of up to max_encode_bytes
    except APIError as exc:
        m.requests.labels(str(exc.status)).inc()
        raise
    m.queue_depth.inc()
    start = time.perf_counter()
    try:
        ctx = contextvars.copy_context()  # so the worker thread's log lines carry the request id
        done = await state.executor.run(request_id_var.get(), lambda: ctx.run(_timed, w, m, items))
    except ImageError as exc:
        m.requests.labels("400").inc()
        raise bad_request(str(exc), param="image", code="invalid_image") from exc
    except UndecodableVideo as exc:
        m.requests.labels("400").inc()
        index = next(i for i, it in enumerate(items) if it.mm_hash == exc.mm_hash)
        raise bad_request(str(exc), param=f"items.{index}.data", code=exc.code) from exc
    except Exception as exc:  # noqa: BLE001 - one call's failure is that call's own error; the executor goes on
        logger.exception("encode failed")
        m.requests.labels("500").inc()
        raise APIError(500, f"encoding failed: {type(exc).__name__}", code="encode_failed") from exc
    finally:
        m.queue_depth.dec()
    m.encode_seconds.observe(time.perf_counter() - start)
    m.requests.labels("200").inc()
    m.items_encoded.inc(sum(not d.cached for d in done))
    m.items_already_cached.inc(sum(d.cached for d in done))
    epoch, seq = w.producer.position()
    reply = EncodeResponse(items=done, ec_address=w.producer.address, ec_epoch=epoch, ec_seq=seq)
    return Response(msgspec.json.encode(reply), media_type="application/json")


@router.get("/health")
@router.head("/health", include_in_schema=False)  # HEAD: the same status, no body
async def health(request: Request) -> dict[str, object]:
    state = _state(request)
    w, _ = state.ready()
    return {"status": "ok", "role": "encoder", "model": state.cfg.model, "model_identity": state.identity,
            "ec_address": w.producer.address,
            "ec_events_address": w.producer.events_address, "ec_epoch": w.producer.epoch,
            "num_encoded": w.num_encoded, "pid": os.getpid(), "loaded": loaded_summary(w.vision.module)}


def create_app(cfg: EncoderConfig, worker: EncoderWorker | None = None) -> FastAPI:
    """The encoder app; builds its worker at startup unless one is given (tests)."""
    state = EncoderState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        w = state.worker = worker if worker is not None else await asyncio.to_thread(build_worker, cfg)
        freeze_startup_heap()
        state.metrics = EncoderMetrics(state.registry, w.producer.stats)
        state.identity = model_identity(w.vision.model_dir, cfg.model)
        logger.info("encoder ready: model=%s device=%s dtype=%s ec_address=%s", cfg.model, w.vision.device,
                    str(w.vision.dtype).removeprefix("torch."), w.producer.address)
        yield
        state.executor.shutdown()
        w.producer.close()

    app = FastAPI(title="EPD encoder", lifespan=lifespan)
    app.state.encoder = state
    install_error_handlers(app)
    install_request_id(app)
    install_metrics(app, state.registry)
    install_body_limit(app, cfg.max_body_bytes, cfg.body_read_timeout)  # bytes received, chunked or not
    install_api_key(app, cfg.internal_key, ("/encode",), "internal key")
    app.include_router(router)
    return app
