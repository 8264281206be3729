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
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from common.cli import parse_config, run_worker, worker_parser
from common.errors import APIError, bad_request, install_error_handlers
from common.http import freeze_startup_heap, install_api_key, install_metrics, install_request_id
from connector import ECProducer
from encoder_service.config import EncoderConfig
from encoder_service.metrics import EncoderMetrics
from encoder_service.protocol import EncodeRequest, EncodeResponse
from encoder_service.worker import EncoderWorker, ScheduledEncoderInput
from models.halves import VisionHalf, loaded_summary
from models.images import ImageError
from models.resolve import resolve_model

logger = logging.getLogger("epd.encoder")


def _decode_items(req: EncodeRequest) -> list[ScheduledEncoderInput]:
    out = []
    for i, item in enumerate(req.items):
        try:
            out.append(ScheduledEncoderInput(item.mm_hash, base64.b64decode(item.data, validate=True)))
        except (binascii.Error, ValueError) as exc:
            raise bad_request(f"items[{i}].data is not valid base64: {exc}", param=f"items.{i}.data") from exc
    return out


def build_worker(cfg: EncoderConfig) -> EncoderWorker:
    vision = VisionHalf(resolve_model(cfg.model), cfg.dtype, cfg.device)
    producer = ECProducer(bind=cfg.ec_bind, cache_bytes=cfg.ec_cache_bytes, events_bind=cfg.ec_events_bind,
                          curve=cfg.curve, advertise_host=cfg.ec_advertise_host).start()
    return EncoderWorker(vision, producer, cfg.max_batch_size, cfg.max_image_pixels)


def create_app(cfg: EncoderConfig, worker: EncoderWorker | None = None) -> FastAPI:
    """The encoder app; builds its worker at startup unless one is given (tests)."""
    state: dict[str, EncoderWorker] = {}
    registry = CollectorRegistry()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epd-encode")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["worker"] = worker if worker is not None else await asyncio.to_thread(build_worker, cfg)
        freeze_startup_heap()
        app.state.metrics = EncoderMetrics(registry, state["worker"].producer.stats)
        vision = state["worker"].vision
        logger.info("encoder ready: model=%s device=%s dtype=%s ec_address=%s", cfg.model, vision.device,
                    str(vision.dtype).removeprefix("torch."), state["worker"].producer.address)
        yield
        executor.shutdown(wait=True)
        state["worker"].producer.close()

    app = FastAPI(title="EPD encoder", lifespan=lifespan)
    install_error_handlers(app)
    install_request_id(app)
    install_metrics(app, registry)
    install_api_key(app, cfg.internal_key, ("/encode",), "internal key")

    @app.post("/encode", response_model=EncodeResponse)
    async def encode(req: EncodeRequest) -> EncodeResponse:
        w, m = state["worker"], app.state.metrics
        items = _decode_items(req)
        m.queue_depth.inc()
        start = time.perf_counter()
        try:
            ctx = contextvars.copy_context()  # so the worker thread's log lines carry the request id
            done = await asyncio.get_running_loop().run_in_executor(executor, ctx.run, w.execute_mm_encoder, items)
        except ImageError as exc:
            m.requests.labels("400").inc()
            raise bad_request(str(exc), param="image", code="invalid_image") from exc
        finally:
            m.queue_depth.dec()
        m.encode_seconds.observe(time.perf_counter() - start)
        m.requests.labels("200").inc()
        m.items_encoded.inc(sum(not d.cached for d in done))
        m.items_already_cached.inc(sum(d.cached for d in done))
        epoch, seq = w.producer.position()
        return EncodeResponse(items=done, ec_address=w.producer.address, ec_epoch=epoch, ec_seq=seq)

    @app.get("/health")
    async def health() -> dict[str, object]:
        if "worker" not in state:
            raise APIError(503, "encoder is loading", code="not_ready")
        w = state["worker"]
        return {"status": "ok", "role": "encoder", "model": cfg.model, "ec_address": w.producer.address,
                "ec_events_address": w.producer.events_address, "ec_epoch": w.producer.epoch,
                "num_encoded": w.num_encoded, "pid": os.getpid(), "loaded": loaded_summary(w.vision.module)}

    return app


def parse_args(argv: list[str] | None = None) -> EncoderConfig:
    d = EncoderConfig()
    p = worker_parser("epd-encoder", "EPD encoder worker (vision tower + projector only)", d)
    p.add_argument("--ec-bind", default=d.ec_bind, help="ZeroMQ endpoint for embeddings (tcp://HOST:PORT or ipc://)")
    p.add_argument("--ec-events-bind", default=d.ec_events_bind,
                   help="ZeroMQ PUB endpoint for cache events (default: beside --ec-bind, port + 1 or random)")
    p.add_argument("--ec-advertise-host", default=d.ec_advertise_host,
                   help="host other machines reach this encoder's ZeroMQ endpoints at (needed when --ec-bind is "
                        "tcp://0.0.0.0:PORT); default: the bound address")
    p.add_argument("--ec-cache-bytes", type=int, default=d.ec_cache_bytes,
                   help="bytes of embeddings this encoder keeps (LRU; in-flight items are never evicted)")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels)
    return parse_config(p, argv, EncoderConfig)


def main(argv: list[str] | None = None) -> None:
    run_worker("encoder", parse_args(argv), create_app)


if __name__ == "__main__":
    main()
