"""HTTP front of an encoder worker: POST /encode, GET /health, GET /metrics; console script epd-encoder."""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgspec
from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CollectorRegistry

from connector.tensors.disk_format import file_key
from connector.tensors.disk_tier import DiskTier
from connector.tensors.producer import ECProducer
from encoder_service.config import EncoderConfig
from encoder_service.encode_scheduler import BatchStats, Busy, EncodeScheduler
from encoder_service.lora import attach_vision_loras
from encoder_service.metrics import EncoderMetrics
from encoder_service.worker import EncoderWorker, ScheduledEncoderInput
from epd_common.errors import APIError, bad_request, install_error_handlers
from epd_common.http import install_api_key, install_body_limit, install_metrics, install_request_id, internal_pid
from epd_common.images import ImageError
from epd_common.logs import request_id_var
from epd_common.server import freeze_startup_heap
from epd_common.tracing import install_tracing, span, start_tracing
from epd_contracts.audio import part_hash as audio_part_hash
from epd_contracts.encode import EncodeRequest, EncodeResponse
from epd_contracts.hashing import adapter_hash, mm_hash
from epd_contracts.validation import ContractError, decode_json
from epd_contracts.video import part_hash
from epd_models.audio_jobs import UndecodableAudio, audio_limits
from epd_models.halves import VisionHalf, loaded_summary
from epd_models.identity import encoder_fingerprint, model_identity
from epd_models.lora.peft_format import LoRAError
from epd_models.resolve import resolve_model
from epd_models.torch_threads import setup_off_loop
from epd_models.video_config import video_limits
from epd_models.video_jobs import UndecodableVideo

logger = logging.getLogger("epd.encoder")
router = APIRouter()
BUSY_RETRY_AFTER_S = 1  # a 503 encoder_busy's Retry-After: the queue moves in about a batch's time


@dataclass
class EncoderState:
    """Everything the routes share (`app.state.encoder`); the worker and its metrics exist once it is built."""

    cfg: EncoderConfig
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    worker: EncoderWorker | None = None
    # the one encode thread: every call's items batched, requests in turn (encoder_service/encode_scheduler.py)
    scheduler: EncodeScheduler | None = None
    metrics: EncoderMetrics | None = None
    identity: dict[str, object] = field(default_factory=dict)
    refused: str | None = None  # why it would not start (a LoRAError: a refused adapter; epd-encoder exits 2)

    def ready(self) -> tuple[EncoderWorker, EncoderMetrics]:
        """The worker and its metrics, or a 503 while it is built."""
        if self.worker is None or self.metrics is None or self.scheduler is None:
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


def _decode_items(req: EncodeRequest, loras: dict[str, int]) -> list[ScheduledEncoderInput]:
    """Decode each item and hash its bytes here: a caller never chooses the hash an embedding is stored under
    (`loras`: the vision half's adapters by name; an image under one is keyed by adapter_hash)."""
    out = []
    for i, item in enumerate(req.items):
        try:
            data = base64.b64decode(item.data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise bad_request(f"items[{i}].data is not valid base64: {exc}", param=f"items.{i}.data") from exc
        for kind, part in (("a video", item.video), ("an audio clip", item.audio)):
            if part is not None and (item.detail != "auto" or item.multi_image):
                raise bad_request(f"items[{i}] is {kind}: detail and multi_image are for images",
                                  param=f"items.{i}.{'video' if item.video is not None else 'audio'}")
        if item.video is not None and item.audio is not None:
            raise bad_request(f"items[{i}] is either a video or an audio clip", param=f"items.{i}.audio")
        computed = (part_hash(data, item.video) if item.video is not None
                    else audio_part_hash(data, item.audio) if item.audio is not None
                    else mm_hash(data, item.detail, item.multi_image))
        if item.lora and (item.lora not in loras or item.video is not None or item.audio is not None):
            raise bad_request(f"items[{i}]: LoRA adapter {item.lora!r} has no vision-tower weights on this encoder "
                              f"(it applies {sorted(loras) or 'none'}, to images only)", param=f"items.{i}.lora",
                              code="invalid_lora")
        computed = adapter_hash(computed, item.lora)
        if item.mm_hash is not None and item.mm_hash != computed:
            raise bad_request(f"items[{i}].mm_hash does not match the hash of its bytes (epd_contracts.hashing, "
                              "epd_contracts.video for a video, epd_contracts.audio for audio)",
                              param=f"items.{i}.mm_hash", code="hash_mismatch")
        out.append(ScheduledEncoderInput(computed, data, item.detail, item.multi_image, item.video, item.audio,
                                         loras.get(item.lora, 0)))
    return out


def build_scheduler(cfg: EncoderConfig, w: EncoderWorker, m: EncoderMetrics) -> EncodeScheduler:
    def on_batch(stats: BatchStats) -> None:
        m.run_seconds.inc(stats.seconds)
        m.batch_items.observe(stats.items)
        m.batch_tokens.observe(stats.tokens)
        for wait in stats.waits:
            m.queue_wait.observe(wait)
            m.item_encode.observe(stats.seconds / stats.items)
    return EncodeScheduler(w.run, cfg.max_encode_batch_items, cfg.max_encode_batch_tokens,
                           cfg.max_pending_encode_tokens, w.vision.batches_exactly, on_batch,
                           on_failed=lambda hashes: w.producer.mark_failed(hashes))


def build_worker(cfg: EncoderConfig) -> EncoderWorker:
    vision = VisionHalf(resolve_model(cfg.model), cfg.dtype, cfg.device)
    attach_vision_loras(vision, cfg)  # LoRAError: a refused adapter (exit 2)
    disk = None
    if cfg.ec_disk_dir is not None:
        fingerprint = encoder_fingerprint(vision.model_dir, str(vision.dtype), str(vision.device))
        disk = DiskTier(cfg.ec_disk_dir, cfg.ec_disk_bytes, fingerprint, key=file_key(cfg.internal_key))
    producer = ECProducer(disk=disk, bind=cfg.ec_bind, cache_bytes=cfg.ec_cache_bytes, events_bind=cfg.ec_events_bind,
                          curve=cfg.curve, advertise_host=cfg.ec_advertise_host,
                          max_items_per_get=cfg.ec_max_items_per_get, max_reply_bytes=cfg.ec_max_reply_bytes,
                          max_parked_gets=cfg.ec_max_parked_gets, max_parked_hashes=cfg.ec_max_parked_hashes,
                          shm=cfg.ec_shm == "auto").start()
    return EncoderWorker(vision, producer, cfg.max_batch_size, cfg.max_image_pixels,
                         video_limits(cfg, cfg.max_encode_bytes), audio_limits(cfg, cfg.max_encode_bytes))


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
        loras = w.vision.lora.slots if w.vision.lora is not None else {}
        items = await asyncio.to_thread(_decode_items, req, loras)  # base64 and sha256 of up to max_encode_bytes
    except APIError as exc:
        m.requests.labels(str(exc.status)).inc()
        raise
    m.queue_depth.inc()
    start = time.perf_counter()
    try:
        ctx = contextvars.copy_context()  # so the worker thread's log lines carry the request id
        with span("preprocess", {"epd.items": len(items)}):
            held, jobs = await asyncio.to_thread(ctx.run, w.prepare_inputs, items)  # images decoded: bad bytes: 400s
        if jobs and (ungathered := w.producer.ungathered_bytes(request_id_var.get())) > state.cfg.ungathered_limit:
            raise Busy(ungathered, None, state.cfg.ungathered_limit, "bytes of embeddings wait for decoders to gather them")
        assert state.scheduler is not None  # ready() said so
        batches: dict[int, int] = {}  # the vision forwards its items ran in: id -> items (other requests' too)
        with span("encode", {"epd.items.held": len(held), "epd.items.encoded": len(jobs)}) as traced:
            done = {**held, **await state.scheduler.submit(request_id_var.get(), jobs, batches)}
            if traced is not None and batches:
                traced.set_attributes({"epd.batch_ids": list(batches), "epd.batch_sizes": list(batches.values())})
    except Busy as exc:
        m.requests.labels("503").inc()
        raise APIError(503, f"encoder busy: {exc}", code="encoder_busy",
                       headers={"Retry-After": str(BUSY_RETRY_AFTER_S)}) from exc
    except ImageError as exc:
        m.requests.labels("400").inc()
        raise bad_request(str(exc), param="image", code="invalid_image") from exc
    except (UndecodableVideo, UndecodableAudio) as exc:
        m.requests.labels("400").inc()
        index = next(i for i, it in enumerate(items) if it.mm_hash == exc.mm_hash)
        raise bad_request(str(exc), param=f"items.{index}.data", code=exc.code) from exc
    except Exception as exc:  # noqa: BLE001 - one call's failure is that call's own error; the thread goes on
        logger.exception("encode failed")
        m.requests.labels("500").inc()
        raise APIError(500, f"encoding failed: {type(exc).__name__}", code="encode_failed") from exc
    finally:
        m.queue_depth.dec()
    m.encode_seconds.observe(time.perf_counter() - start)
    m.requests.labels("200").inc()
    described = w.describe(items, done)
    m.items_encoded.inc(sum(not d.cached for d in described))
    m.items_already_cached.inc(sum(d.cached for d in described))
    epoch, seq = w.producer.position()
    reply = EncodeResponse(items=described, ec_address=w.producer.address, ec_epoch=epoch, ec_seq=seq)
    return Response(msgspec.json.encode(reply), media_type="application/json")


@router.get("/health")
@router.head("/health", include_in_schema=False)  # HEAD: the same status, no body
async def health(request: Request) -> dict[str, object]:
    state = _state(request)
    w, _ = state.ready()
    return {"status": "ok", "role": "encoder", "model": state.cfg.model, "model_identity": state.identity,
            "ec_address": w.producer.address,
            "ec_events_address": w.producer.events_address, "ec_epoch": w.producer.epoch,
            "num_encoded": w.num_encoded, "loaded": loaded_summary(w.vision.module),
            **internal_pid(request.headers, state.cfg.internal_key)}


def create_app(cfg: EncoderConfig, worker: EncoderWorker | None = None) -> FastAPI:
    """The encoder app; builds its worker at startup unless one is given (tests)."""
    state = EncoderState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            w = state.worker = worker if worker is not None else await setup_off_loop(
                functools.partial(build_worker, cfg))
        except LoRAError as exc:
            logger.critical("encoder cannot start: %s", exc)
            state.refused = str(exc)
            raise
        freeze_startup_heap()
        state.metrics = EncoderMetrics(state.registry, w.producer.stats)
        state.scheduler = build_scheduler(cfg, w, state.metrics)
        state.metrics.pending_tokens.set_function(lambda: state.scheduler.pending_tokens if state.scheduler else 0)
        state.identity = model_identity(w.vision.model_dir, cfg.model)
        logger.info("encoder ready: model=%s device=%s dtype=%s ec_address=%s", cfg.model, w.vision.device,
                    str(w.vision.dtype).removeprefix("torch."), w.producer.address)
        yield
        if state.scheduler is not None:
            state.scheduler.shutdown()
        w.producer.close()

    app = FastAPI(title="EPD encoder", lifespan=lifespan)
    app.state.encoder = state
    install_error_handlers(app)
    start_tracing("epd-encoder", cfg)
    install_tracing(app, ("/encode",))
    install_request_id(app)
    install_metrics(app, state.registry)
    install_body_limit(app, cfg.max_body_bytes, cfg.body_read_timeout)  # bytes received, chunked or not
    install_api_key(app, cfg.internal_key, ("/encode",), "internal key")
    app.include_router(router)
    return app
