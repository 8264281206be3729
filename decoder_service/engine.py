"""The decoder engine: continuous batching on its own thread.

Each step decodes every running sequence in one batched forward, then prefills waiting prompts within a
token budget (chunked), so a long multi-image prefill delays running streams by at most one budget per
step. Requests join when a slot is free and leave the step after they finish or their client goes.
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

from common.errors import APIError, bad_request
from common.logs import request_id_var
from connector import ECConsumer, MissingEmbeddings
from decoder_service.aggregated import InlineEncoder
from decoder_service.batch import BatchRunner
from decoder_service.config import DecoderConfig
from decoder_service.generate import eos_token_ids
from decoder_service.metrics import DecoderMetrics
from decoder_service.prompt import Prompt, build_prompt
from decoder_service.protocol import Event, GenerateRequest
from decoder_service.sampling import SamplingParams
from decoder_service.sequence import Job, Sequence
from models.base import ImageFeatures
from models.chat import chat_template, render
from models.halves import LanguageHalf

logger = logging.getLogger("epd.decoder")
_IDLE_PREFILL_FACTOR = 8  # with no stream decoding there is no latency to protect


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
        self._thread = threading.Thread(target=self._loop, name="epd-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Requests not running yet (queued for a slot)."""
        return self._jobs.qsize() + len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.seqs)

    def prepare(self, req: GenerateRequest) -> tuple[Prompt, SamplingParams]:
        """Gather embeddings and build the prompt (blocking); raises APIError for what cannot run."""
        try:  # before the gather: with pipelined encode this overlaps the encoder's work
            ids = render(self.lm.tokenizer, req.messages, self.template)
        except (TemplateError, ValueError, TypeError, KeyError) as exc:
            raise bad_request(f"cannot build the prompt: {exc}", param="messages") from exc
        images = self._gather(req)
        try:
            prompt = build_prompt(self.lm, ids, images)
        except ValueError as exc:  # placeholder count does not match the images
            raise bad_request(f"cannot build the prompt: {exc}", param="messages") from exc
        room = self.max_model_len - prompt.num_tokens
        max_tokens = req.max_tokens or room
        if max_tokens > room or room < 1:
            raise bad_request(f"prompt ({prompt.num_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                              f"model's maximum length ({self.max_model_len})", param="max_tokens",
                              code="context_length_exceeded")
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                top_k=req.top_k, seed=req.seed, stop=tuple(req.stop), ignore_eos=req.ignore_eos,
                                frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty)
        return prompt, params

    def submit(self, prompt: Prompt, params: SamplingParams) -> Job:
        job = Job(prompt=prompt, params=params, loop=asyncio.get_running_loop(), request_id=request_id_var.get())
        self._jobs.put(job)
        return job

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

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
        self.metrics.gather.observe(time.perf_counter() - start)
        return [ImageFeatures(embeds=got[h].embeds, grid_thw=got[h].grid_thw) for h in hashes]

    def _loop(self) -> None:
        while not self._stopping:
            self._take_new_jobs(block=not self.seqs and not self.waiting)
            self._abort_cancelled()
            self._admit()
            try:
                self._step()
            except Exception as exc:  # a failed step ends its sequences with an error event; the loop survives
                logger.exception("engine step failed")
                for key in list(self.seqs):
                    seq = self._drop(key, "error")
                    seq.job.emit(Event(type="error", message=f"generation failed: {type(exc).__name__}: {exc}"))
        for key in list(self.seqs):  # closing: running streams end cleanly instead of hanging
            self._drop(key, "abort").finish("abort")

    def _take_new_jobs(self, block: bool) -> None:
        try:
            job = self._jobs.get(block=block)
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
            self._drop(key, "abort").finish("abort")
        for job in [j for j in self.waiting if j.cancelled.is_set()]:
            self.waiting.remove(job)
            self.finished["abort"] += 1

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
            self.runner.add(key, job.prompt)
            self.seqs[key] = Sequence(job, self.lm.tokenizer, self.eos_ids, self.metrics, self.lm.device)
        self.peak_running = max(self.peak_running, len(self.seqs))

    def _step(self) -> None:
        # decode: every sequence past its prefill feeds back its last token
        feed: dict[Hashable, int] = {k: seq.pending for k, seq in self.seqs.items() if seq.pending is not None}
        self._on_logits(self.runner.decode(feed))
        # prefill: waiting prompts, in chunks, within the per-step token budget
        self._on_logits(self.runner.prefill(self.prefill_budget))

    def _on_logits(self, logits: dict[Hashable, torch.Tensor]) -> None:
        if not logits:
            return
        keys = [key for key in logits if isinstance(key, int)]
        assert len(keys) == len(logits), "engine keys are ints"
        # every row chooses on the device; the choices come back to the host in one transfer (one sync)
        chosen = torch.stack([self.seqs[key].sampler.choose(logits[key]) for key in keys]).tolist()
        for key, token in zip(keys, chosen, strict=True):
            seq = self.seqs[key]
            request_id_var.set(seq.job.request_id)
            seq.pending = None
            reason = seq.on_token(token)
            if reason is not None:
                self._drop(key, reason).finish(reason)

    def _drop(self, key: int, reason: str) -> Sequence:
        self.runner.remove(key)
        self.finished[reason] += 1
        return self.seqs.pop(key)
