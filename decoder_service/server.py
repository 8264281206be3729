"""HTTP front of a decoder worker: POST /generate (NDJSON), GET /health, GET /metrics; epd-decoder."""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry

from common.cli import parse_config, run_worker, worker_parser
from common.errors import APIError, install_error_handlers
from common.http import freeze_startup_heap, install_api_key, install_metrics, install_request_id
from common.logs import request_id_var
from connector import ECConsumer
from decoder_service.aggregated import InlineEncoder
from decoder_service.config import DecoderConfig
from decoder_service.engine import Engine
from decoder_service.metrics import DecoderMetrics
from decoder_service.protocol import GenerateRequest
from decoder_service.sequence import Job
from models.halves import LanguageHalf, VisionHalf, loaded_summary
from models.resolve import resolve_model

logger = logging.getLogger("epd.decoder")


async def _stream(job: Job, request_id: str) -> AsyncIterator[bytes]:
    request_id_var.set(request_id)
    try:
        while True:
            event = await job.events.get()
            yield (event.model_dump_json(exclude_none=True) + "\n").encode()
            if event.type != "delta":
                return
    finally:  # client gone (or done): stop the sequence at its next step
        job.cancelled.set()


def create_app(cfg: DecoderConfig, lm: LanguageHalf | None = None) -> FastAPI:
    """The decoder app; loads its LM at startup unless one is given (tests)."""
    state: dict[str, Engine] = {}
    registry = CollectorRegistry()
    consumer = ECConsumer(cache_bytes=cfg.ec_cache_bytes, curve=cfg.curve)
    metrics = DecoderMetrics(registry, lambda: consumer.stats())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        half = lm if lm is not None else await asyncio.to_thread(
            LanguageHalf, resolve_model(cfg.model), cfg.dtype, cfg.device)
        inline = None
        if cfg.aggregated:  # the vision half runs on the LM's device
            vision = await asyncio.to_thread(VisionHalf, half.model_dir, cfg.dtype, half.device)
            inline = InlineEncoder(vision, cfg.ec_cache_bytes, cfg.max_image_pixels)
        state["engine"] = Engine(half, consumer, cfg, metrics, inline)
        freeze_startup_heap()
        engine = state["engine"]
        logger.info("decoder ready: model=%s device=%s dtype=%s max_model_len=%d, KV slots %d x %d positions = "
                    "%.1f MiB", cfg.model, half.device, str(half.dtype).removeprefix("torch."), engine.max_model_len,
                    cfg.max_num_seqs, engine.max_model_len, engine.runner.cache.nbytes / 2**20)
        yield
        await asyncio.to_thread(state["engine"].close)
        consumer.close()

    app = FastAPI(title="EPD decoder", lifespan=lifespan)
    app.state.engine_ref = state  # "engine" -> Engine once started (tests inspect it)
    install_error_handlers(app)
    install_request_id(app)
    install_metrics(app, registry)
    install_api_key(app, cfg.internal_key, ("/generate",), "internal key")

    @app.post("/generate")
    async def generate(req: GenerateRequest) -> StreamingResponse:
        engine = state["engine"]
        if engine.num_waiting >= cfg.max_queued:
            raise APIError(503, "decoder queue is full", code="overloaded")
        metrics.waiting.inc()
        try:
            prompt, params = await asyncio.to_thread(engine.prepare, req)
        except APIError as exc:
            metrics.requests.labels(str(exc.status)).inc()
            metrics.waiting.dec()
            raise
        job = engine.submit(prompt, params)
        metrics.requests.labels("200").inc()

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in _stream(job, request_id_var.get()):
                    yield chunk
            finally:
                metrics.waiting.dec()

        return StreamingResponse(body(), media_type="application/x-ndjson")

    @app.get("/health")
    async def health() -> dict[str, object]:
        if "engine" not in state:
            raise APIError(503, "decoder is loading", code="not_ready")
        engine = state["engine"]
        loaded = loaded_summary(engine.lm.module)
        if engine.inline is not None:  # aggregated mode holds both halves
            vision = loaded_summary(engine.inline.vision.module)
            loaded = {"modules": sorted([*loaded["modules"], *vision["modules"]]),  # type: ignore[misc]
                      "num_parameters": loaded["num_parameters"] + vision["num_parameters"],  # type: ignore[operator]
                      "num_encoded": engine.inline.num_encoded}
        return {"status": "ok", "role": "decoder", "model": cfg.model, "aggregated": cfg.aggregated,
                "waiting": engine.num_waiting, "running": engine.num_running, "pid": os.getpid(), "loaded": loaded}

    return app


def parse_args(argv: list[str] | None = None) -> DecoderConfig:
    d = DecoderConfig()
    p = worker_parser("epd-decoder", "EPD decoder worker (language model only)", d)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-queued", type=int, default=d.max_queued, help="requests waiting for a slot; more get 503")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="sequences decoded together; a KV slot of --max-model-len is preallocated for each")
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                   help="prompt tokens prefilled per engine step while streams decode (8x when none do)")
    p.add_argument("--gather-timeout", type=float, default=d.gather_timeout)
    p.add_argument("--aggregated", action="store_true",
                   help="also load the vision tower and encode images sent inline (one process, no encoders)")
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels, help="aggregated mode")
    p.add_argument("--ec-cache-bytes", type=int, default=d.ec_cache_bytes,
                   help="bytes of gathered embeddings this decoder keeps (LRU)")
    return parse_config(p, argv, DecoderConfig)


def main(argv: list[str] | None = None) -> None:
    run_worker("decoder", parse_args(argv), create_app)


if __name__ == "__main__":
    main()
