"""The decoder engine: continuous batching on its own thread.

Each step reads as nano-vllm's `LLMEngine.step`: the scheduler decides it (`decoder_service/engine/scheduler.py`:
admission and the prefill-token budget), the runner runs it (`BatchRunner.run`: every running sequence
decoded in one batched forward, then waiting prompts prefilled in chunks within the budget, so a long
multi-image prefill delays running streams by at most one budget per step), and `postprocess` samples,
detokenizes and streams each row's token.

Fault isolation: everything done for one request on this thread (admission with its sampler and seed,
embedding merge and positions, its prefill chunks, its sampling choice, accept, detokenization, stop
checks, events) runs in that request's own `try`: a failure ends that request alone (all its n choices) with
one `error` event and frees its slots; the other rows keep their tokens. What a request needs besides its
rows (prompt tokens, checked sampling, a compiled guide, a tool parser) is built off this thread, in
`Engine.prepare` (decoder_service/request.py). A batched decode that fails is retried row by row
(`BatchRunner.decode`), so only the row that fails alone is ended. Anything that fails outside per-request
code is an engine fault: every request gets an error event, `problem()` reports it, and the watchdog
(`decoder_service/watchdog.py`) makes /health answer 503 and the process exit.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Any, cast

import torch

from connector.tensors.consumer import ECConsumer, Received
from connector.tensors.errors import InvalidEmbeddings, MissingEmbeddings
from decoder_service.aggregated import InlineEncoder
from decoder_service.config import DecoderConfig
from decoder_service.engine import cpu_linear
from decoder_service.engine.eos import eos_token_ids
from decoder_service.engine.kv_blocks import kv_layout
from decoder_service.engine.logprobs import TokenTable
from decoder_service.engine.memory_plan import plan_engine
from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.outputs import RunnerOutput
from decoder_service.engine.readback import read_back, read_back_rows
from decoder_service.engine.sampling import choose_rows
from decoder_service.engine.scheduler import Scheduler
from decoder_service.engine.sequence import Job, Sequence, hold_events, release_events
from decoder_service.grammar import CompiledGuide
from decoder_service.grammar_pool import Abandoned, CompilePool
from decoder_service.handoff import HandoffDeclined, HandoffOut, KVFetch, resume_from
from decoder_service.job_trace import gather_transport, note_chunks, prefilling
from decoder_service.metrics import DecoderMetrics
from decoder_service.prompt import Prompt
from decoder_service.request import PendingGuide, Preparer, Work
from decoder_service.video_gather import Gathered, plan_gather
from epd_common.errors import APIError, bad_request
from epd_common.logs import request_id_var
from epd_common.tracing import span
from epd_contracts.generate import GenerateRequest, Handoff
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf
from epd_models.mrope import MRopeAdapter
from epd_models.video_config import video_config

logger = logging.getLogger("epd.decoder")
_MAX_HEARTBEAT_S = 1.0  # an idle engine still marks progress this often (the stall clock never sees idleness)
_ENGINE_STOPPED = "generation failed: the decoder engine stopped; retry on another decoder"


class Engine:
    def __init__(self, lm: LanguageHalf, consumer: ECConsumer, cfg: DecoderConfig, metrics: DecoderMetrics,
                 inline: InlineEncoder | None = None, handoff_out: HandoffOut | None = None,
                 kv_fetch: KVFetch | None = None, fingerprint: str = ""):
        """`handoff_out`: this worker prefills for others (E -> P -> D); `kv_fetch`: it continues requests others
        prefilled, fetching their K/V (decoder_service/handoff.py)."""
        self.lm, self.consumer, self.cfg, self.metrics = lm, consumer, cfg, metrics
        self.inline = inline  # aggregated mode: images arrive inline and are encoded here
        self.handoff_out, self.kv_fetch = handoff_out, kv_fetch
        self._handing_off: dict[Job, None] = {}  # prefill-only jobs whose first tokens came this step
        self.eos_ids = eos_token_ids(lm)
        self.plan = plan_engine(cfg, lm)  # K/V blocks and max_model_len from the memory budget
        if self.plan.warning:
            logger.warning("%s", self.plan.warning)
        self.max_model_len = self.plan.max_model_len
        self.vocab_size = int(lm.module.lm_head.out_features)
        self.video_config = video_config(lm.model_dir, lm.adapter.name)  # None: the model takes no video
        self.preparer = Preparer(lm, self.max_model_len, self.vocab_size, cfg.max_num_seqs, self.eos_ids,
                                 cfg.block_size if cfg.prefix_cache_bytes else 0)
        self._jobs: queue.Queue[Job | None] = queue.Queue()  # submitted, not yet taken by the engine thread
        self.compiles = CompilePool(cfg.grammar_compile_threads, cfg.grammar_compile_timeout)
        self.runner = ModelRunner(lm, cfg.max_num_seqs, self.max_model_len, chunk=1 << 30,
                                  prefix_bytes=cfg.prefix_cache_bytes, prefix_block=cfg.block_size,
                                  num_blocks=self.plan.num_blocks)
        self.runner.before_forward = release_events  # the held events go while the forward runs (step())
        if lm.device.type == "cuda":
            self.runner.enable_graphs(cfg.enforce_eager)
        if cfg.cpu_packed_linear and lm.device.type == "cpu" and cpu_linear.available():
            logger.info("--cpu-packed-linear: %d linears prepacked for oneDNN", cpu_linear.pack_linears(lm.module))
        if self.runner.prefix is not None:
            metrics.prefix_stats = self.runner.prefix.stats
        self.kv_layout = kv_layout(self.runner.shape, cfg.block_size, fingerprint)
        new_sequence = functools.partial(Sequence, tokenizer=lm.tokenizer, eos_ids=self.eos_ids, metrics=metrics,
                                         device=lm.device, tokens=TokenTable(lm.tokenizer))
        self.scheduler = Scheduler(self.runner, cfg.max_prefill_tokens, new_sequence,  # engine thread only
                                   cfg.num_batched_tokens, cfg.seqs_per_request)
        metrics.kv_stats = self.kv_summary
        self._stopping = False
        self.progress_at = time.monotonic()  # when the loop last completed an iteration
        self.dead: str | None = None  # why the engine thread stopped working, once it has
        self._heartbeat_s = min(_MAX_HEARTBEAT_S, cfg.engine_stall_timeout / 4)
        self._thread = threading.Thread(target=self._run, name="epd-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Requests not running yet (queued for a slot)."""
        return self._jobs.qsize() + len(self.scheduler.waiting) + self.compiles.num_queued

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def prefix_summary(self) -> dict[str, object]:
        """/health's view of the prefix cache (what the proxy routes conversations by)."""
        prefix = self.runner.prefix
        return prefix.summary() if prefix is not None else {"enabled": False}

    def kv_summary(self) -> dict[str, int]:
        """/health's and /metrics' view of the K/V pool (read off the engine thread: plain ints)."""
        return {**self.runner.blocks.pool_summary(), "bytes_per_token": self.runner.shape.bytes_per_token,
                "preemptions": self.scheduler.num_preempted}

    def problem(self) -> tuple[str, str] | None:
        """(code, reason) when the engine cannot serve: its thread died, or no loop iteration for too long."""
        if self.dead is not None:
            return "engine_dead", f"engine thread died: {self.dead}"
        if self._stopping:  # closing on purpose
            return None
        if not self._thread.is_alive():
            return "engine_dead", "engine thread exited"
        stalled_s = time.monotonic() - self.progress_at
        if stalled_s > self.cfg.engine_stall_timeout:
            return "engine_stalled", (f"engine made no progress for {stalled_s:.0f} s "
                                      f"(--engine-stall-timeout {self.cfg.engine_stall_timeout:g})")
        return None

    def prepare(self, req: GenerateRequest, guide: CompiledGuide | None = None, compiled: bool = False) -> Work:
        """Tokens, embeddings, checked sampling and guide (blocking: a worker thread); APIError for what cannot run.
        `compiled`: `guide` is the request's, from `Engine.guide` (else it is compiled here)."""
        work = self.preparer.prepare(req, self._gather, guide=guide, compiled=compiled)
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
        resume = resume_from(handoff, work.prompt.num_tokens, self.kv_fetch, self.kv_layout, self.runner.shape,
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

    def submit(self, work: Work | Prompt, params: SamplingParams | None = None,
               cancelled: threading.Event | None = None) -> Job:
        """Queue prepared work (or a bare prompt with its params); a job cancelled before a slot takes it never runs."""
        if (problem := self.problem()) is not None:
            raise APIError(503, problem[1], code=problem[0])
        if isinstance(work, Prompt):
            assert params is not None, "a bare prompt needs its sampling parameters"
            work = Work(work, params)
        job = Job(work=work, loop=asyncio.get_running_loop(), request_id=request_id_var.get(),
                  cancelled=cancelled or threading.Event())
        self._jobs.put(job)
        if self.dead is not None:  # died meanwhile: whoever takes a queued job from the queue ends it
            self._fail_queued()
        return job

    def close(self, timeout: float = 30.0) -> None:
        self.compiles.close()
        self._jobs.put(None)
        self._thread.join(timeout=timeout)

    def _gather(self, req: GenerateRequest) -> list[Gathered]:
        """Each image's (video's) embeddings, and which of its rows were already held (cached_tokens). Videos are
        gathered as their chunks, with the images, and assembled (decoder_service/video_gather.py)."""
        if not req.images:
            return []
        with span("gather", {"epd.items": len(req.images)}) as traced:  # its connector gets carry its traceparent
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

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the thread must never end without saying why
            self._die(exc)

    def _loop(self) -> None:
        while not self._stopping:
            if self.scheduler.is_idle:
                release_events()  # nothing runs next: the last step's events go now
            self._take_new_jobs(block=self.scheduler.is_idle)
            self.step()
            self.progress_at = time.monotonic()
        release_events()
        self.scheduler.abort_all()

    def step(self) -> None:
        """Schedule, one forward, postprocess. A step's events are held from its postprocess until the next step's
        forward starts (`runner.before_forward`), or the engine idles: the loops' threads take them while the
        forward runs, and the next step's host work is not interrupted by them."""
        try:
            scheduled = self.scheduler.schedule()
            before = prefilling(self.runner.rows)  # None unless tracing is on
            out = self.runner.run(scheduled)
            if before:
                note_chunks(before, self.runner.rows, self.scheduler.running)
        finally:
            release_events()  # the forward had none to overlap (a step with no forward), or it failed
        hold_events()
        try:
            self.postprocess(out)
        except BaseException:
            release_events()
            raise

    def postprocess(self, out: RunnerOutput) -> None:
        """End the rows whose forward failed; every other row samples its token, then streams it or finishes.

        Plain greedy rows choose in one batched argmax, every other row by its own sampler in its own try
        (sampling.choose_rows); every row's token comes back in one transfer, logprobs in one more."""
        for key, (stage, exc) in out.failed.items():
            assert isinstance(key, int), "engine keys are ints"
            self.scheduler.fail(key, exc, stage)
        running = self.scheduler.running
        keys = cast(list[int], list(out.logits))  # the engine's row keys are ints (Scheduler)
        picked, batch = choose_rows([(key, seq.sampler) for key in keys if (seq := running.get(key)) is not None],
                                    out.logits)
        chosen: dict[int, torch.Tensor] = {}
        for key, choice in picked.items():
            if isinstance(choice, Exception):
                self.scheduler.fail(key, choice, "sampling")
            else:
                chosen[key] = choice
        tokens = read_back(chosen, self.vocab_size, batch)
        packed = {k: p for k in chosen if (seq := running.get(k)) is not None and (p := seq.sampler.packed) is not None}
        logprobs = read_back_rows(packed)  # rows that asked for logprobs: one more transfer for all of them
        for key in keys:  # in the runner's order, as each row chose (events held: step())
            if (token := tokens.get(key)) is not None:
                self._accept(key, token, logprobs.get(key))
        if self._handing_off:
            self._hand_off()

    def _hand_off(self) -> None:
        """Prefill-only jobs whose choices all have their first token: their K/V kept for a decode worker, a
        `handoff` event, their rows freed (decoder_service/handoff.py)."""
        assert self.handoff_out is not None
        jobs, self._handing_off = list(self._handing_off), {}
        running = self.scheduler.running
        for job in jobs:
            keys = [k for k in self.scheduler.keys.get(job, []) if k in running]
            if not keys:  # every choice ended at its first token: their `done`s end the stream
                continue
            request_id_var.set(job.request_id)
            try:  # the blocks are copied out now; the `handoff` event follows once they are kept
                self.handoff_out.hand_off(job, [running[k] for k in keys], self.runner.rows[keys[0]].blocks,
                                          self.runner.cache)
            except Exception as exc:
                self.scheduler.fail(keys[0], exc, "handoff")
                continue
            for key in keys:
                self.scheduler.finish(key, "handoff")

    def _accept(self, key: int, token: int | Exception, logprobs: list[float] | None = None) -> None:
        """The row's chosen token becomes its text and events; it finishes on a stop, or fails (with its siblings)."""
        seq = self.scheduler.running.get(key)
        if seq is None:  # a sibling choice failed this step: the whole job ended
            return
        request_id_var.set(seq.job.request_id)
        try:
            if isinstance(token, Exception):
                raise token
            seq.pending = None
            reason = seq.on_token(token, logprobs)
        except Exception as exc:
            self.scheduler.fail(key, exc, "output")
            return
        if seq.job.work.handoff_key is not None and seq.num_generated == 1:
            self._handing_off[seq.job] = None  # its first token: handed off after this step's postprocess
        if reason is not None:
            self.scheduler.finish(key, reason)

    def _die(self, exc: BaseException) -> None:
        """An engine fault (not one request's): say so everywhere, end every request with an error."""
        self.dead = f"{type(exc).__name__}: {exc}"
        logger.critical("engine thread died: %s", self.dead, exc_info=exc)
        release_events()
        for job in self.scheduler.drain():
            job.emit_error(_ENGINE_STOPPED)
        self._fail_queued()

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.emit_error(_ENGINE_STOPPED)

    def _take_new_jobs(self, block: bool) -> None:
        try:  # idle: wake every heartbeat, so a live idle engine keeps marking progress
            job = self._jobs.get(block=block, timeout=self._heartbeat_s if block else None)
            while True:
                if job is None:
                    self._stopping = True
                    return
                self.scheduler.add(job)
                job = self._jobs.get_nowait()
        except queue.Empty:
            pass
