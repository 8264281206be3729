"""The decoder engine: continuous batching on its own thread, prepared work in, events out.

`LLMEngine.step` reads as nano-vllm's: `Scheduler.schedule` decides the step (admission, preemption, the prefill
budget; decoder_service/engine/scheduler.py), `run` runs it (`ModelRunner.run`: every running sequence decoded in
one batched forward with waiting prompts' chunks within the budget, so a long multi-image prefill delays running
streams by at most one budget per step), and `postprocess` samples, detokenizes and streams each row's token.

The engine imports nothing of the service around it (an import-linter contract keeps it so): the service shell
(decoder_service/shell.py) prepares each request into `Work` (engine/work.py) off this thread, and passes in the
settings, metrics hooks and hand-off sink of engine/interfaces.py.

Fault isolation: everything done for one request on this thread (admission with its sampler and seed, embedding
merge and positions, its prefill chunks, its sampling choice, accept, detokenization, stop checks, events) runs in
that request's own `try`: a failure ends that request alone (all its n choices) with one `error` event and frees
its slots; the other rows keep their tokens. A batched forward that fails is retried row by row (`ModelRunner`), so
only the row that fails alone is ended. Anything that fails outside per-request code is an engine fault: every
request gets an error event, `problem()` reports it, and the service's watchdog makes /health answer 503 and the
process exit.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import cast

from decoder_service.engine import cpu_attention, cpu_fusion, cpu_linear
from decoder_service.engine.eos import eos_token_ids
from decoder_service.engine.interfaces import EngineSettings, SequenceMetrics
from decoder_service.engine.logprobs import TokenTable
from decoder_service.engine.memory_plan import plan_engine
from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.outbox import hold_events, release_events
from decoder_service.engine.outputs import RunnerOutput, SchedulerOutput
from decoder_service.engine.postprocess import HandoffSink, hand_off, postprocess
from decoder_service.engine.scheduler import Scheduler
from decoder_service.engine.sequence import Job, Sequence
from decoder_service.engine.spec.propose import make_speculator
from decoder_service.engine.work import Prompt, Work
from epd_common.errors import APIError
from epd_common.logs import request_id_var
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf

logger = logging.getLogger("epd.decoder")
_MAX_HEARTBEAT_S = 1.0  # an idle engine still marks progress this often (the stall clock never sees idleness)
_ENGINE_STOPPED = "generation failed: the decoder engine stopped; retry on another decoder"


def _never() -> bool:
    return False


class LLMEngine:
    def __init__(self, lm: LanguageHalf, cfg: EngineSettings, metrics: SequenceMetrics,
                 handoff_out: HandoffSink | None = None, trace_chunks: Callable[[], bool] = _never):
        """`handoff_out`: this worker prefills for others (E -> P -> D): each such job's K/V goes there after its first
        tokens. `trace_chunks`: whether to note each prompt chunk's time on its job (for the service's traces)."""
        self.lm, self.cfg, self.metrics = lm, cfg, metrics
        self.handoff_out, self.trace_chunks = handoff_out, trace_chunks
        self.eos_ids = eos_token_ids(lm)
        self.plan = plan_engine(cfg, lm)  # K/V blocks and max_model_len from the memory budget
        if self.plan.warning:
            logger.warning("%s", self.plan.warning)
        self.max_model_len = self.plan.max_model_len
        self.vocab_size = int(lm.module.lm_head.out_features)
        self._jobs: queue.Queue[Job | None] = queue.Queue()  # submitted, not yet taken by the engine thread
        self.runner = ModelRunner(lm, cfg.max_num_seqs, self.max_model_len, chunk=1 << 30,
                                  prefix_bytes=cfg.prefix_cache_bytes, prefix_block=cfg.block_size,
                                  num_blocks=self.plan.num_blocks)
        self.runner.before_forward = release_events  # the held events go while the forward runs (step())
        if lm.device.type == "cuda":
            self.runner.enable_graphs(cfg.enforce_eager)
        if cpu_linear.wanted(cfg.cpu_exact_linear, lm.device):  # the CPU default; --cpu-exact-linear: F.linear
            logger.info("%s", cpu_linear.pack_model(lm.module))
            logger.info("%s", cpu_fusion.fuse_model(lm.module))  # SiLU x up and RMSNorm without tensors of their own
        if cpu_attention.wanted(cfg.cpu_sdpa_attention, lm.device):  # the CPU default; --cpu-sdpa-attention: gather
            self.runner.use_decode_kernel(cpu_attention.load())
        new_sequence = functools.partial(Sequence, tokenizer=lm.tokenizer, eos_ids=self.eos_ids, metrics=metrics,
                                         device=lm.device, tokens=TokenTable(lm.tokenizer))
        spec = getattr(cfg, "speculative_config", None)
        self.speculator = make_speculator(spec, lm, self.runner, self.plan.num_blocks) if spec is not None else None
        self.scheduler = Scheduler(self.runner, cfg.max_prefill_tokens, new_sequence,  # engine thread only
                                   cfg.num_batched_tokens, cfg.seqs_per_request, self.speculator)
        self._stopping = False
        self.progress_at = time.monotonic()  # when the loop last completed an iteration
        self.dead: str | None = None  # why the engine thread stopped working, once it has
        self._heartbeat_s = min(_MAX_HEARTBEAT_S, cfg.engine_stall_timeout / 4)
        self._thread = threading.Thread(target=self._main, name="epd-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Requests not running yet (queued for a slot)."""
        return self._jobs.qsize() + len(self.scheduler.waiting)

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

    def spec_summary(self) -> dict[str, object] | None:
        """/metrics' view of speculative decoding (None when it is off): drafts, tokens proposed and accepted."""
        return self.speculator.stats.summary() if self.speculator is not None else None

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
        self._jobs.put(None)
        self._thread.join(timeout=timeout)

    # -- the engine thread ----------------------------------------------------------------------------------
    def _main(self) -> None:
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
        """Schedule, run (one forward), postprocess. A step's events are held from its postprocess until the next
        step's forward starts (`runner.before_forward`), or the engine idles: the loops' threads take them while the
        forward runs, and the next step's host work is not interrupted by them."""
        scheduled = self.scheduler.schedule()
        out = self.run(scheduled)
        self.postprocess(out)

    def run(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """The step's forward; the events held since the last postprocess go when it starts, or after it (a step with
        no forward, or one that failed). While `trace_chunks`, each prompt chunk's time is noted on its job."""
        try:
            before = self._prefilling() if self.trace_chunks() else None
            out = self.runner.run(scheduled)
            if before:
                self._note_chunks(before)
            return out
        finally:
            release_events()

    def postprocess(self, out: RunnerOutput) -> None:
        """Each row's token sampled, streamed or finished (engine/postprocess.py), its events held until the next
        forward (`step`); then the prefill-only jobs whose first tokens came are handed off."""
        hold_events()
        try:
            first = postprocess(out, self.scheduler, self.vocab_size,
                                self.speculator.stats if self.speculator is not None else None)
            if first:
                assert self.handoff_out is not None, "a hand-off job on an engine with no hand-off sink"
                hand_off(first, self.scheduler, self.runner, self.handoff_out)
        except BaseException:
            release_events()
            raise

    def _prefilling(self) -> dict[Hashable, int]:
        """Before the forward: each row still prefilling -> its length."""
        return {key: row.length for key, row in self.runner.rows.items() if not row.prefilled}

    def _note_chunks(self, before: dict[Hashable, int]) -> None:
        """After the forward: each row that prefilled a chunk notes (time, tokens) on its job."""
        now = time.perf_counter()  # NOTE: on CUDA, when the forward was queued (no sync here)
        rows, running = self.runner.rows, self.scheduler.running
        for key, length in before.items():
            row, seq = rows.get(key), running.get(cast(int, key))
            if row is not None and seq is not None and row.length > length:
                seq.job.prefill_chunks.append((now, row.length - length))

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
