"""One running request on the engine thread: its sampler, detokenizer, stop rules and events."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from decoder_service.detokenizer import IncrementalDetokenizer
from decoder_service.metrics import DecoderMetrics
from decoder_service.prompt import Prompt
from decoder_service.sampling import Sampler
from epd_contracts.generate import Event, Usage
from epd_contracts.sampling import SamplingParams

logger = logging.getLogger("epd.decoder")


@dataclass(eq=False)  # NOTE: identity, not field equality (comparing prompts' tensors raises)
class Job:
    prompt: Prompt
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    request_id: str = "-"
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # perf_counter() of each chosen token (engine side)

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def fail(self, exc: Exception, stage: str) -> None:
        """This request failed on the engine thread: log why, tell its client where to look."""
        logger.error("request %s failed in %s: %s: %s", self.request_id, stage, type(exc).__name__, exc, exc_info=exc)
        self.emit_error(f"generation failed ({stage}: {type(exc).__name__}); see the decoder log for request "
                        f"{self.request_id}")

    def emit_error(self, message: str) -> None:
        try:
            self.emit(Event(type="error", message=message))
        except Exception:  # noqa: BLE001 - its event loop is gone: nobody is left to tell
            logger.warning("request %s: could not deliver its error event", self.request_id)


class Sequence:
    """Turns each chosen token into events; `pending` is the token the next decode step feeds back."""

    def __init__(self, job: Job, tokenizer: object, eos_ids: set[int], metrics: DecoderMetrics,
                 device: torch.device | str = "cpu"):
        self.job, self.metrics = job, metrics
        self.sampler = Sampler(job.params, device)  # on the LM's device, where the logits are
        self.detok = IncrementalDetokenizer(tokenizer, job.params.stop)
        self.eos = set() if job.params.ignore_eos else eos_ids
        self.num_generated = 0
        self.last = job.arrival
        self.pending: int | None = None

    def on_token(self, token: int) -> str | None:
        """Take the token `sampler.choose` picked (read back by the caller); returns the finish reason if done."""
        self.sampler.accept(token)
        now = time.perf_counter()
        (self.metrics.ttft if self.num_generated == 0 else self.metrics.itl).observe(now - self.last)
        self.last, self.num_generated = now, self.num_generated + 1
        self.job.token_times.append(now)
        if token in self.eos:
            return "stop"
        text = self.detok.add(token)
        if text:
            self.job.emit(Event(type="delta", text=text))
        if self.detok.stopped:
            return "stop"
        if self.job.params.max_tokens is not None and self.num_generated >= self.job.params.max_tokens:
            return "length"
        self.pending = token
        return None

    def finish(self, reason: str) -> None:
        """Flush held-back text and send `done` with usage (image tokens count as prompt tokens)."""
        tail = self.detok.flush()
        if tail and reason != "abort":
            self.job.emit(Event(type="delta", text=tail))
        prompt = self.job.prompt
        self.metrics.generated_tokens.inc(self.num_generated)
        self.metrics.prompt_tokens.inc(prompt.num_tokens)
        self.metrics.e2e.observe(time.perf_counter() - self.job.arrival)
        usage = Usage(prompt_tokens=prompt.num_tokens, completion_tokens=self.num_generated,
                      total_tokens=prompt.num_tokens + self.num_generated,
                      num_image_tokens=sum(im.num_tokens for im in prompt.images))
        self.job.emit(Event(type="done", finish_reason=reason, usage=usage))  # type: ignore[arg-type]
