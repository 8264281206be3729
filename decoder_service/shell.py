"""The service shell around the engine: `Engine` is the decoder's LLMEngine (decoder_service/engine/) with what
serving a request needs before the engine thread sees it.

Off the engine thread (`prepare`, on a worker thread; `guide`, on the grammar pool): the prompt's tokens and checked
sampling (decoder_service/request.py), the request's grammar compiled (decoder_service/grammar_pool.py), its
images' embeddings gathered from the encoders (or encoded inline, aggregated: decoder_service/aggregated.py) and
traced, and on a decode worker the prefill worker's K/V fetched (decoder_service/handoff.py). What comes out is
`Work` (decoder_service/engine/work.py), which `submit` queues for the engine. The engine gets this service's
metrics and hand-off sink as objects (decoder_service/engine/interfaces.py says what it needs of them).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from connector.tensors.consumer import ECConsumer, Received
from connector.tensors.errors import InvalidEmbeddings, MissingEmbeddings
from decoder_service.aggregated import InlineEncoder
from decoder_service.config import DecoderConfig
from decoder_service.engine.kv_blocks import kv_layout
from decoder_service.engine.llm_engine import LLMEngine
from decoder_service.engine.work import Work
from decoder_service.grammar import CompiledGuide
from decoder_service.grammar_pool import Abandoned, CompilePool
from decoder_service.handoff import HandoffDeclined, HandoffOut, KVFetch, resume_from
from decoder_service.job_trace import gather_transport
from decoder_service.lora import attach_loras
from decoder_service.metrics import DecoderMetrics
from decoder_service.request import PendingGuide, Preparer
from decoder_service.video_gather import Gathered, plan_gather
from epd_common import tracing
from epd_common.errors import APIError, bad_request
from epd_contracts.generate import GenerateRequest, Handoff
from epd_models.halves import LanguageHalf
from epd_models.mrope import MRopeAdapter
from epd_models.video_config import video_config

logger = logging.getLogger("epd.decoder")


class Engine(LLMEngine):
    cfg: DecoderConfig
    metrics: DecoderMetrics
    handoff_out: HandoffOut | None

    def __init__(self, lm: LanguageHalf, consumer: ECConsumer, cfg: DecoderConfig, metrics: DecoderMetrics,
                 inline: InlineEncoder | None = None, handoff_out: HandoffOut | None = None,
                 kv_fetch: KVFetch | None = None, fingerprint: str = ""):
        """`handoff_out`: this worker prefills for others (E -> P -> D); `kv_fetch`: it continues requests others
        prefilled, fetching their K/V (decoder_service/handoff.py)."""
        attach_loras(lm, cfg)  # before the engine packs the linears (LoRAError: a refused adapter, exit 2)
        super().__init__(lm, cfg, metrics, handoff_out, trace_chunks=tracing.enabled)
        try:
            self.consumer, self.kv_fetch = consumer, kv_fetch
            self.inline = inline  # aggregated mode: images arrive inline and are encoded here
            self.video_config = video_config(lm.model_dir, lm.adapter.name)  # None: the model takes no video
            self.preparer = Preparer(lm, self.max_model_len, self.vocab_size, cfg.max_num_seqs, self.eos_ids,
                                     cfg.block_size if cfg.prefix_cache_bytes else 0)
            self.compiles = CompilePool(cfg.grammar_compile_threads, cfg.grammar_compile_timeout)
            self.kv_layout = kv_layout(self.runner.wire_shape, cfg.block_size, fingerprint)
        except BaseException:
            super().close()
            raise
        if self.runner.prefix is not None:
            metrics.prefix_stats = self.runner.prefix.stats
        metrics.kv_stats = self.kv_summary
        metrics.spec_stats = self.spec_summary  # speculative decoding's counters (None: off)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: compiling their grammar, or queued for a slot."""
        return super().num_waiting + self.compiles.num_queued

    def close(self, timeout: float = 30.0) -> None:
        self.compiles.close()
        super().close(timeout)

    def prepare(self, req: GenerateRequest, guide: CompiledGuide | None = None, compiled: bool = False) -> Work:
        """Tokens, embeddings, checked sampling and guide (blocking: a worker thread); APIError for what cannot run.
        `compiled`: `guide` is the request's, from `Engine.guide` (else it is compiled here)."""
        work = self.preparer.prepare(req, self._gather, guide=guide, compiled=compiled)
        try:
            return self._route(req, work)
        except BaseException:
            self.release(work)
            raise

    def release(self, work: Work) -> None:
        """The request of `work` is over: the LoRA adapter it held may go (decoder_service/lora.py)."""
        self.preparer.release(work.prompt.lora)

    def _route(self, req: GenerateRequest, work: Work) -> Work:
        """A prefill worker's hand-off (checked worth it), or a continued one; else `work` as it is."""
        if req.handoff_key is not None:
            if self.handoff_out is None:
                raise bad_request("this decoder does not prefill for hand-offs (it is not --role prefill)",
                                  param="handoff_key")
            self._worth_handing_off(work)
            work = dataclasses.replace(work, handoff_key=req.handoff_key)
        elif req.handoff is not None:
            work = self.continue_from(work, req.handoff)
        return work

    def _worth_handing_off(self, work: Work) -> None:
        """HandoffDeclined for a prompt with fewer than --handoff-min-tokens tokens not in this pool's prefix cache:
        its prefill is short, and a hand-off would cost its stream more than prefilling it on the decode worker."""
        held = self.runner.blocks.held_prefix(work.chain.keys) if work.chain is not None else 0
        new = work.prompt.num_tokens - held * self.runner.block_size
        if new < self.cfg.handoff_min_tokens:
            raise HandoffDeclined(f"{new} prompt tokens to prefill, under --handoff-min-tokens "
                                  f"{self.cfg.handoff_min_tokens}")

    def continue_from(self, work: Work, handoff: Handoff) -> Work:
        """`work` continuing a prefill worker's hand-off: its blocks fetched and checked (blocking: a worker thread),
        all but those this pool's prefix cache holds under the same keys; without them it prefills here."""
        held = self.runner.blocks.held_prefix(work.chain.keys) if work.chain is not None else 0
        resume = resume_from(handoff, work.prompt.num_tokens, self.kv_fetch, self.kv_layout, self.runner.wire_shape,
                             self.cfg.gather_timeout, held)
        self.metrics.handoffs.labels("kv" if resume.kv is not None else "recomputed").inc()
        return dataclasses.replace(work, resume=resume)

    async def guide(self, req: GenerateRequest, left: asyncio.Future[Any]) -> CompiledGuide | None:
        """The request's grammar: looked up and checked on a worker thread, compiled on the grammar pool (so no
        other request's preparation waits behind it); `left` completing (the client went away) stops the wait,
        and a compile not yet started never runs. 400 naming the field for a schema it refuses."""
        if req.response_format is None and not req.tools:
            return None
        found = await asyncio.to_thread(self.preparer.find_guide, req)
        if not isinstance(found, PendingGuide):
            return found
        try:
            return await self.compiles.run(found.compile, left)
        except Abandoned as exc:
            if exc.reason == "left":
                raise APIError(499, "the client went away before its grammar was compiled", code="client_closed") \
                    from None
            raise bad_request(f"{found.param}: the schema took longer than --grammar-compile-timeout "
                              f"({self.cfg.grammar_compile_timeout:g} s) to compile", param=found.param,
                              code="schema_too_complex") from None

    def _gather(self, req: GenerateRequest) -> list[Gathered]:
        """Each image's (video's) embeddings, and which of its rows were already held (cached_tokens). Videos are
        gathered as their chunks, with the images, and assembled (decoder_service/video_gather.py)."""
        if not req.images:
            return []
        with tracing.span("gather", {"epd.items": len(req.images)}) as traced:  # its gets carry its traceparent
            received: Received = {}  # bytes fetched by transport
            got = self._gather_traced(req, received)
            if traced is not None:
                traced.set_attributes({"epd.bytes": sum(g.features.nbytes for g in got),
                                       **gather_transport(received, self.inline is not None)})
            return got

    def _gather_traced(self, req: GenerateRequest, received: Received) -> list[Gathered]:
        if self.inline is not None:
            return [Gathered.of(f, hit) for f, hit in self.inline.features_and_hits(req.images)]
        plan = plan_gather(req.images, self.video_config, self.lm.video_token_id is not None,
                           self.lm.audio_token_id is not None)
        start = time.perf_counter()
        try:
            got = self.consumer.gather(plan.hashes, plan.sources, self.cfg.gather_timeout, wait_for=plan.pending,
                                       received=received)
        except MissingEmbeddings as exc:  # by the hash of each image or video chunk not found
            raise APIError(409, str(exc), param="images", code="missing_embeddings",
                           extra={"missing": exc.missing}) from exc
        except InvalidEmbeddings as exc:  # the encoder that sent them runs another model (or is broken)
            raise APIError(502, str(exc), param="images", code="invalid_embeddings",
                           extra={"refused": exc.reasons}) from exc
        self.metrics.gather.observe(time.perf_counter() - start)
        self.metrics.gathered_bytes.observe(sum(f.nbytes for f in got.values()))
        # the proxy marks images and chunks held before (ImageRef.cached, ChunkRef.cached)
        return plan.assemble(got, self.video_config.temporal_patch if self.video_config is not None else 1,
                             needs_grid=isinstance(self.lm.adapter, MRopeAdapter))
