"""A decoder's start: its LM loaded, its K/V pool planned, its engine built and watched.

The LM's load and the engine's build run on threads that end with them, and the threads that prepare requests run
torch alone, so the engine thread holds the process's only OpenMP team (epd_models/torch_threads.py; an aggregated
decoder encodes images on those threads, with every core, and is left as it was; so is a tensor-parallel one, whose
ranks must be started from a thread that lives on).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor

from decoder_service.aggregated import InlineEncoder
from decoder_service.embedding_check import EmbeddingCheck
from decoder_service.engine.kv_blocks import kv_layout
from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.memory_plan import plan_for
from decoder_service.engine.tp.load import load_language
from decoder_service.handoff import HandoffEndpoints
from decoder_service.shell import Engine
from decoder_service.state import DecoderState
from decoder_service.watchdog import FatalHandler, Watchdog
from epd_models.audio_jobs import audio_limits
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.identity import model_identity
from epd_models.resolve import resolve_model
from epd_models.torch_threads import setup_off_loop, torch_on_one_thread
from epd_models.video_config import video_limits

logger = logging.getLogger("epd.decoder")


async def start_engine(state: DecoderState, lm: LanguageHalf | None, on_fatal: FatalHandler) -> Watchdog:
    """Load the LM (unless given) and, aggregated, the vision half on its device; start the engine."""
    cfg = state.cfg
    # tensor-parallel ranks get SIGKILL when the thread that started them ends (PR_SET_PDEATHSIG follows the thread):
    # they are loaded, as before, on an executor thread that lives on, and that executor stays the default
    ranks = cfg.tensor_parallel_size > 1
    if not cfg.aggregated and not ranks:  # request preparation's torch ops start no OpenMP team (aggregated: encodes)
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="epd-prepare", initializer=torch_on_one_thread))
    load = functools.partial(load_language, resolve_model(cfg.model), dtype=cfg.dtype, device=cfg.device,
                             quantized=cfg.quantized_weights, size=cfg.tensor_parallel_size,
                             timeout_s=cfg.tensor_parallel_timeout)
    if lm is not None:
        half = lm
    else:  # no OpenMP team left behind (epd_models/torch_threads.py), but for the ranks' sake
        half = await (asyncio.to_thread(load) if ranks else setup_off_loop(load))
    try:
        return await _start_on(state, half, on_fatal)
    except BaseException:
        if half.ranks is not None and lm is None:  # the ranks this decoder started go with it
            half.ranks.kill()
        raise


async def _start_on(state: DecoderState, half: LanguageHalf, on_fatal: FatalHandler) -> Watchdog:
    """Plan the K/V pool, load the vision half when aggregated, open the hand-off endpoints, start the engine."""
    cfg = state.cfg
    if (quant := half.quant.summary()) is not None:
        logger.info("quantized checkpoint: %s, %d linears %s", quant["format"], quant["quantized_linears"],
                 quant["weights"])
    plan_for(cfg, half)  # what the K/V budget cannot hold is refused before anything else starts (KVPlanError)
    check = state.embedding_check = EmbeddingCheck(half)
    state.identity.update(model_identity(half.model_dir, cfg.model))
    inline = None
    if cfg.aggregated:
        vision = await setup_off_loop(functools.partial(VisionHalf, half.model_dir, cfg.dtype, half.device))
        inline = InlineEncoder(vision, cfg.ec_cache_bytes, cfg.max_image_pixels, check,
                               video_limits(cfg, cfg.max_body_bytes), audio_limits(cfg, cfg.max_body_bytes))
    layout = kv_layout(KVShape.of(half.config.get_text_config(), half.dtype), cfg.block_size,
                       str(state.identity["fingerprint"]))
    state.handoff = HandoffEndpoints.start(cfg.role, layout, cfg.curve, cfg.kv_bind, cfg.kv_advertise_host,
                                           cfg.kv_store_bytes, cfg.kv_ttl, shm=cfg.ec_shm == "auto")
    state.metrics.kv_store_stats = state.handoff.stats  # a prefill worker's hand-off store on /metrics
    engine = state.engine = await setup_off_loop(functools.partial(  # packs the linears, zeroes the K/V pool
        Engine, half, state.consumer, cfg, state.metrics, inline, handoff_out=state.handoff.out,
        kv_fetch=state.handoff.fetch, fingerprint=layout.fingerprint))
    kv = engine.kv_summary()
    logger.info("decoder ready: model=%s device=%s dtype=%s max_model_len=%d, K/V pool %d blocks x %d positions x "
                "%d bytes = %.1f MiB (%s)", cfg.model, half.device, str(half.dtype).removeprefix("torch."),
                engine.max_model_len, kv["blocks_total"], kv["block_size"], kv["bytes_per_token"],
                engine.runner.cache.nbytes / 2**20, engine.plan.source)
    return Watchdog(engine, on_fatal, cfg.engine_stall_timeout)
