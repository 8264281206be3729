"""The decoder engine: continuous batching on its own thread.

Each step decodes every running sequence in one batched forward, then prefills waiting prompts within a
token budget (chunked), so a long multi-image prefill delays running streams by at most one budget per
step. Requests join when a slot is free and leave the step after they finish or their client goes.

Fault isolation: everything done for one request on this thread (admission with its sampler and seed,
embedding merge and positions, its prefill chunks, its sampling choice, accept, detokenization, stop
checks, events) runs in that request's own `try`: a failure ends that request alone with an `error` event
and frees its slot; the other rows keep their tokens. A batched decode that fails is retried row by row
(`BatchRunner.decode`), so only the row that fails alone is ended. Anything that fails outside per-request
code is an engine fault: every request gets an error event, `problem()` reports it, and the watchdog
(`decoder_service/watchdog.py`) makes /health answer 503 and the process exit.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Hashable

import torch
from jinja2 import TemplateError

from connector import ECConsumer, InvalidEmbeddings, MissingEmbeddings
from decoder_service.aggregated import InlineEncoder
from decoder_service.batch import BatchRunner
from decoder_service.config import DecoderConfig
from decoder_service.generate import eos_token_ids
from decoder_service.metrics import DecoderMetrics
from decoder_service.prompt import Prompt, build_prompt
from decoder_service.protocol import Event, GenerateRequest
from decoder_service.sampling import SamplingParams
from decoder_service.sequence import Job, Sequence
from epd_common.errors import APIError, bad_request
from epd_common.logs import request_id_var
from epd_models.base import ImageFeatures
from epd_models.chat import PromptTooLong, chat_template, render
from epd_models.halves import LanguageHalf

logger = logging.getLogger("epd.decoder")
_IDLE_PREFILL_FACTOR = 8  # with no stream decoding there is no latency to protect
_MAX_HEARTBEAT_S = 1.0  # an idle engine still marks progress this often (the stall clock never sees idleness)
_ENGINE_STOPPED = "generation failed: the decoder engine stopped; retry on another decoder"


class Engine:
    def __init__(self, lm: LanguageHalf, consumer: ECConsumer, cfg: DecoderConfig, metrics: DecoderMetrics,
                 inline: InlineEncoder | None = None):
        self.lm, self.consumer, self.cfg, self.metrics = lm, consumer, cfg, metrics
        self.inline = inline  # aggregated mode: images arrive inline and are encoded here
        self.template = chat_template(lm.tokenizer, lm.model_dir)
        self.eos_ids = eos_token_ids(lm)
        self.max_model_len = cfg.max_model_len or int(lm.config.get_text_config().max_position_embeddings)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self.waiting: collections.deque[Job] = collections.deque()  # engine thread only
        self.seqs: dict[int, Sequence] = {}  # slot key -> running sequence; engine thread only
        self.runner = BatchRunner(lm, cfg.max_num_seqs, self.max_model_len,
                                  chunk=cfg.max_prefill_tokens * _IDLE_PREFILL_FACTOR)
        self.finished: Counter[str] = Counter()  # finish_reason -> sequences
        self.peak_running = 0  # most sequences decoded together so far
        self._keys = itertools.count()
        self._stopping = False
        self.vocab_size = int(lm.module.lm_head.out_features)
        self.progress_at = time.monotonic()  # when the loop last completed an iteration
        self.dead: str | None = None  # why the engine thread stopped working, once it has
        self._heartbeat_s = min(_MAX_HEARTBEAT_S, cfg.engine_stall_timeout / 4)
        self._thread = threading.Thread(target=self._run, name="epd-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Requests not running yet (queued for a slot)."""
        return self._jobs.qsize() + len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.seqs)

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

    def prepare(self, req: GenerateRequest) -> tuple[Prompt, SamplingParams]:
        """Gather embeddings and build the prompt (blocking); raises APIError for what cannot run."""
        try:  # before the gather: with pipelined encode this overlaps the encoder's work
            ids = render(self.lm.tokenizer, req.messages, self.template, max_tokens=self.max_model_len)
        except PromptTooLong as exc:  # refused before the whole prompt is tokenized
            raise bad_request(f"{exc} (the model's maximum length)", param="messages",
                              code="context_length_exceeded") from exc
        except (TemplateError, ValueError, TypeError, KeyError) as exc:
            raise bad_request(f"cannot build the prompt: {exc}", param="messages") from exc
        images = self._gather(req)
        try:
            prompt = build_prompt(self.lm, ids, images)
        except ValueError as exc:  # placeholder count does not match the images
            raise bad_request(f"cannot build the prompt: {exc}", param="messages") from exc
        room = self.max_model_len - prompt.num_tokens
        max_tokens = req.sampling.max_tokens or room
        if max_tokens > room or room < 1:
            raise bad_request(f"prompt ({prompt.num_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                              f"model's maximum length ({self.max_model_len})", param="max_tokens",
                              code="context_length_exceeded")
        params = req.sampling.with_max_tokens(max_tokens)
        return prompt, params

    def submit(self, prompt: Prompt, params: SamplingParams, cancelled: threading.Event | None = None) -> Job:
        """Queue a prepared request; a job whose `cancelled` is set before a slot takes it never runs."""
        if (problem := self.problem()) is not None:
            raise APIError(503, problem[1], code=problem[0])
        job = Job(prompt=prompt, params=params, loop=asyncio.get_running_loop(), request_id=request_id_var.get(),
                  cancelled=cancelled or threading.Event())
        self._jobs.put(job)
        if self.dead is not None:  # died meanwhile: whoever takes a queued job from the queue ends it
            self._fail_queued()
        return job

    def close(self, timeout: float = 30.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=timeout)

    def _gather(self, req: GenerateRequest) -> list[ImageFeatures]:
        if not req.images:
            return []
        if self.inline is not None:
            return self.inline.features(req.images)
        hashes = [im.mm_hash for im in req.images]
        start = time.perf_counter()
        try:
            got = self.consumer.gather(hashes, {im.mm_hash: im.source for im in req.images}, self.cfg.gather_timeout,
                                       wait_for=[im.mm_hash for im in req.images if im.pending])
        except MissingEmbeddings as exc:
            raise APIError(409, str(exc), param="images", code="missing_embeddings",
                           extra={"missing": exc.missing}) from exc
        except InvalidEmbeddings as exc:  # the encoder that sent them runs another model (or is broken)
            raise APIError(502, str(exc), param="images", code="invalid_embeddings",
                           extra={"refused": exc.reasons}) from exc
        self.metrics.gather.observe(time.perf_counter() - start)
        return [ImageFeatures(embeds=got[h].embeds, grid_thw=got[h].grid_thw) for h in hashes]

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the thread must never end without saying why
            self._die(exc)

    def _loop(self) -> None:
        while not self._stopping:
            self._take_new_jobs(block=not self.seqs and not self.waiting)
            self._abort_cancelled()
            self._admit()
            self._step()
            self.progress_at = time.monotonic()
        for key in list(self.seqs):  # closing: running streams end cleanly instead of hanging
            self._end(key, "abort")

    def _die(self, exc: BaseException) -> None:
        """An engine fault (not one request's): say so everywhere, end every request with an error."""
        self.dead = f"{type(exc).__name__}: {exc}"
        logger.critical("engine thread died: %s", self.dead, exc_info=exc)
        jobs = [seq.job for seq in self.seqs.values()] + list(self.waiting)
        self.seqs.clear()
        self.waiting.clear()
        for job in jobs:
            _emit_error(job, _ENGINE_STOPPED)
        self._fail_queued()

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                _emit_error(job, _ENGINE_STOPPED)

    def _take_new_jobs(self, block: bool) -> None:
        try:  # idle: wake every heartbeat, so a live idle engine keeps marking progress
            job = self._jobs.get(block=block, timeout=self._heartbeat_s if block else None)
            while True:
                if job is None:
                    self._stopping = True
                    return
                self.waiting.append(job)
                job = self._jobs.get_nowait()
        except queue.Empty:
            pass

    def _abort_cancelled(self) -> None:
        """Clients that went away free their slot now, before the next forward."""
        for key in [k for k, seq in self.seqs.items() if seq.job.cancelled.is_set()]:
            self._end(key, "abort")
        num_waiting = len(self.waiting)
        self.waiting = collections.deque(j for j in self.waiting if not j.cancelled.is_set())
        self.finished["abort"] += num_waiting - len(self.waiting)

    @property
    def prefill_budget(self) -> int:
        """Prompt tokens per step: small while streams decode (their inter-token latency), larger when none do."""
        decoding = any(seq.pending is not None for seq in self.seqs.values())
        return self.cfg.max_prefill_tokens * (1 if decoding else _IDLE_PREFILL_FACTOR)

    def _admit(self) -> None:
        """Take waiting requests into free slots, but only as many as this step's prefill budget can start."""
        budget = self.prefill_budget
        while self.waiting and not self.runner.is_full and self.runner.num_prefill_tokens_left < budget:
            job = self.waiting.popleft()
            key = next(self._keys)
            request_id_var.set(job.request_id)
            try:  # its sampler (seed), embedding merge and positions: its failure is its own
                seq = Sequence(job, self.lm.tokenizer, self.eos_ids, self.metrics, self.lm.device)
                self.runner.add(key, job.prompt)
            except Exception as exc:
                self.finished["error"] += 1
                _request_failed(job, exc, "admission")
                continue
            self.seqs[key] = seq
        self.peak_running = max(self.peak_running, len(self.seqs))

    def _step(self) -> None:
        failed: dict[Hashable, Exception] = {}
        # decode: every sequence past its prefill feeds back its last token
        feed: dict[Hashable, int] = {k: seq.pending for k, seq in self.seqs.items() if seq.pending is not None}
        logits = self.runner.decode(feed, failed)
        self._fail_rows(failed, "decode")
        self._on_logits(logits)
        # prefill: waiting prompts, in chunks, within the per-step token budget
        logits = self.runner.prefill(self.prefill_budget, failed)
        self._fail_rows(failed, "prefill")
        self._on_logits(logits)

    def _on_logits(self, logits: dict[Hashable, torch.Tensor]) -> None:
        if not logits:
            return
        keys = [key for key in logits if isinstance(key, int)]
        assert len(keys) == len(logits), "engine keys are ints"
        chosen: dict[int, torch.Tensor] = {}
        for key in keys:  # every row chooses on the device, in its own try
            try:
                chosen[key] = self.seqs[key].sampler.choose(logits[key])
            except Exception as exc:
                self._fail(key, exc, "sampling")
        for key, token in self._read_back(chosen).items():
            seq = self.seqs[key]
            request_id_var.set(seq.job.request_id)
            try:
                if isinstance(token, Exception):
                    raise token
                seq.pending = None
                reason = seq.on_token(token)
            except Exception as exc:
                self._fail(key, exc, "output")
                continue
            if reason is not None:
                self._end(key, reason)

    def _read_back(self, chosen: dict[int, torch.Tensor]) -> dict[int, int | Exception]:
        """Every row's choice to the host in one transfer (one sync). A choice that is not a 0-d integer tensor
        fails its own row before the transfer, so it cannot spoil (or promote) the others' tokens."""
        good = {k: t for k, t in chosen.items() if _is_token_tensor(t)}
        values: dict[int, object] = {k: ValueError(f"sampler returned {_describe(t)}, not a 0-d integer tensor")
                                     for k, t in chosen.items() if k not in good}
        if good:
            try:
                values.update(zip(good, torch.stack(list(good.values())).tolist(), strict=True))
            except Exception:  # e.g. rows on different devices: read each alone
                values.update((k, _scalar(t)) for k, t in good.items())
        return {key: self._token(values[key]) for key in chosen}

    def _token(self, value: object) -> int | Exception:
        if isinstance(value, Exception):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < self.vocab_size:
            return value
        return ValueError(f"sampler chose {value!r}, not a token id in [0, {self.vocab_size})")

    def _fail_rows(self, failed: dict[Hashable, Exception], stage: str) -> None:
        for key, exc in failed.items():
            assert isinstance(key, int), "engine keys are ints"
            self._fail(key, exc, stage)
        failed.clear()

    def _fail(self, key: int, exc: Exception, stage: str) -> None:
        """One request failed: it alone gets an error event, and its slot back."""
        seq = self._drop(key, "error")
        _request_failed(seq.job, exc, stage)

    def _end(self, key: int, reason: str) -> None:
        """Free the slot, then send the request's last text and `done` (an error event if that fails)."""
        seq = self._drop(key, reason)
        try:
            seq.finish(reason)
        except Exception as exc:
            _request_failed(seq.job, exc, "finish")

    def _drop(self, key: int, reason: str) -> Sequence:
        self.runner.remove(key)
        self.finished[reason] += 1
        return self.seqs.pop(key)


def _is_token_tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 0 and not (t.is_floating_point() or t.is_complex()
                                                                or t.dtype == torch.bool)


def _describe(t: object) -> str:
    return f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _scalar(t: torch.Tensor) -> object:
    try:
        return t.item()
    except Exception as exc:
        return exc


def _request_failed(job: Job, exc: Exception, stage: str) -> None:
    logger.error("request %s failed in %s: %s: %s", job.request_id, stage, type(exc).__name__, exc, exc_info=exc)
    _emit_error(job, f"generation failed ({stage}: {type(exc).__name__}); see the decoder log for request "
                     f"{job.request_id}")


def _emit_error(job: Job, message: str) -> None:
    try:
        job.emit(Event(type="error", message=message))
    except Exception:  # noqa: BLE001 - its event loop is gone: nobody is left to tell
        logger.warning("request %s: could not deliver its error event", job.request_id)
