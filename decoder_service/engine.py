"""The decoder engine: one sequence at a time on its own thread; requests queue in front of it."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from jinja2 import TemplateError

from common.errors import APIError, bad_request
from common.logs import request_id_var
from connector import ECConsumer, MissingEmbeddings
from decoder_service.config import DecoderConfig
from decoder_service.detokenizer import IncrementalDetokenizer
from decoder_service.generate import eos_token_ids, generate
from decoder_service.metrics import DecoderMetrics
from decoder_service.prompt import Prompt, build_prompt
from decoder_service.protocol import Event, GenerateRequest, Usage
from decoder_service.sampling import Sampler, SamplingParams
from models.base import ImageFeatures
from models.chat import chat_template, render
from models.halves import LanguageHalf

logger = logging.getLogger("epd.decoder")


@dataclass
class Job:
    prompt: Prompt
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    request_id: str = "-"
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    def __init__(self, lm: LanguageHalf, consumer: ECConsumer, cfg: DecoderConfig, metrics: DecoderMetrics):
        self.lm, self.consumer, self.cfg, self.metrics = lm, consumer, cfg, metrics
        self.template = chat_template(lm.tokenizer, lm.model_dir)
        self.eos_ids = eos_token_ids(lm)
        self.max_model_len = cfg.max_model_len or int(lm.config.get_text_config().max_position_embeddings)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self.running: Job | None = None  # the sequence on the engine thread now
        self.finished: Counter[str] = Counter()  # finish_reason -> sequences
        self._thread = threading.Thread(target=self._loop, name="epd-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self._jobs.qsize()

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
        while (job := self._jobs.get()) is not None:
            request_id_var.set(job.request_id)
            self.running = job
            try:
                self.finished[self._run(job)] += 1
            except Exception as exc:  # a failed request ends with an error event; the loop survives
                logger.exception("generation failed")
                self.finished["error"] += 1
                job.emit(Event(type="error", message=f"generation failed: {type(exc).__name__}: {exc}"))
            finally:
                self.running = None

    def _run(self, job: Job) -> str:
        """Generate for one job; returns its finish reason."""
        p, m = job.params, self.metrics
        detok = IncrementalDetokenizer(self.lm.tokenizer, p.stop)
        eos = set() if p.ignore_eos else self.eos_ids
        finish, num_generated, last = "length", 0, job.arrival
        for token in generate(self.lm, job.prompt, Sampler(p), p.max_tokens, eos):
            now = time.perf_counter()
            (m.ttft if num_generated == 0 else m.itl).observe(now - last)
            last, num_generated = now, num_generated + 1
            if job.cancelled.is_set():
                finish = "abort"
                break
            if token in eos:
                finish = "stop"
                break
            text = detok.add(token)
            if text:
                job.emit(Event(type="delta", text=text))
            if detok.stopped:
                finish = "stop"
                break
        tail = detok.flush()
        if tail:
            job.emit(Event(type="delta", text=tail))
        m.generated_tokens.inc(num_generated)
        m.prompt_tokens.inc(job.prompt.num_tokens)
        m.e2e.observe(time.perf_counter() - job.arrival)
        num_image = sum(im.num_tokens for im in job.prompt.images)
        usage = Usage(prompt_tokens=job.prompt.num_tokens, completion_tokens=num_generated,
                      total_tokens=job.prompt.num_tokens + num_generated, num_image_tokens=num_image)
        job.emit(Event(type="done", finish_reason=finish, usage=usage))  # type: ignore[arg-type]
        return finish
