"""One request (`Job`: its events, n choices) and one choice of it on the engine thread (`Sequence`).

A sequence owns its sampler (seeded for its choice index, with its own grammar matcher), detokenizer, stop
rules and, when the request has tools, its tool-call parser. Each chosen token's logprobs ride on the delta
that carries its text; tokens whose text is held back (a partial character, a possible stop string, a tool
call being parsed) hand theirs to the next delta, or to `done`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from decoder_service.engine.detokenizer import IncrementalDetokenizer
from decoder_service.engine.interfaces import RequestFault, SequenceMetrics
from decoder_service.engine.outbox import Outbox, outbox
from decoder_service.engine.sampling import Sampler
from decoder_service.engine.work import Prompt, Work
from epd_contracts.generate import Event, TokenLogprob, ToolCallDelta, Usage

if TYPE_CHECKING:
    from decoder_service.engine.logprobs import TokenTable
    from epd_contracts.sampling import SamplingParams

logger = logging.getLogger("epd.decoder")


@dataclass(eq=False)  # NOTE: identity, not field equality (comparing prompts' tensors raises); a dict key
class Job:
    work: Work
    loop: asyncio.AbstractEventLoop
    request_id: str = "-"
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0  # perf_counter() when the scheduler gave it rows (0: not yet)
    next_choice: int = 0  # its choices admitted so far (or, continued, passed over): the next one's index
    token_times: list[float] = field(default_factory=list)  # perf_counter() of each chosen token (engine side)
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter(), tokens), tracing on only
    # (name, perf_counter(), attributes) of a choice's preemption and resumption: the `decode` span's events (rare)
    decode_events: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    errored: bool = False  # its one error event is sent: nothing follows it
    reused_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (set at admission)
    spec_draft_tokens: int = 0  # speculative decoding: tokens proposed for its choices, and how many were accepted
    spec_accepted_tokens: int = 0
    outbox: Outbox = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.outbox = outbox(self.loop)

    @property
    def cached_tokens(self) -> int:
        """usage's cached_tokens: the reused prefix, and the tokens of held images past it (no vision work)."""
        return self.reused_tokens + self.work.held_image_tokens_from(self.reused_tokens)

    @property
    def prompt(self) -> Prompt:
        return self.work.prompt

    @property
    def params(self) -> SamplingParams:
        return self.work.params

    def emit(self, event: Event) -> None:
        self.outbox.put(self.events, event)

    def fail(self, exc: Exception, stage: str) -> None:
        """This request failed on the engine thread: log why, tell its client where to look (once)."""
        if self.errored:
            return
        if isinstance(exc, RequestFault):  # e.g. its own schema cannot be completed: a 400 naming it, not a server fault
            logger.info("request %s: %s", self.request_id, exc.message)
            self.emit_error(exc.message, status=400, code=exc.code, param=exc.param)
            return
        logger.error("request %s failed in %s: %s: %s", self.request_id, stage, type(exc).__name__, exc, exc_info=exc)
        self.emit_error(f"generation failed ({stage}: {type(exc).__name__}); see the decoder log for request "
                        f"{self.request_id}")

    def emit_error(self, message: str, status: int | None = None, code: str | None = None,
                   param: str | None = None) -> None:
        if self.errored:
            return
        self.errored = True
        try:
            self.emit(Event(type="error", message=message, status=status, code=code, param=param))
        except Exception:  # noqa: BLE001 - its event loop is gone: nobody is left to tell
            logger.warning("request %s: could not deliver its error event", self.request_id)


class Sequence:
    """Choice `index` of a job: turns each chosen token into events; `pending` is the token the next step feeds back."""

    def __init__(self, job: Job, index: int, tokenizer: object, eos_ids: set[int], metrics: SequenceMetrics,
                 device: torch.device | str = "cpu", tokens: TokenTable | None = None):
        self.job, self.index, self.metrics = job, index, metrics
        work, params = job.work, job.params
        self.guide = work.guide.matcher() if work.guide is not None else None  # each choice its own matcher
        self.sampler = Sampler(params, device, index=index, guide=self.guide,  # on the LM's device, with the logits
                               tokens=tokens if params.logprobs is not None else None)
        self.detok = IncrementalDetokenizer(tokenizer, params.stop)
        self.parser = work.tools.parser() if work.tools is not None else None
        self.stop_ids = (set() if params.ignore_eos else eos_ids) | set(params.stop_token_ids)
        self.max_tokens, self.logprobs = params.max_tokens, params.logprobs is not None  # read per token
        self.entries: list[TokenLogprob] = []  # logprobs of tokens whose text is not sent yet
        self.echo = work.echo  # completions' echo: the prompt's text, sent before the first token's
        self.num_generated = 0
        self.generated: list[int] = []  # every chosen token (the prefix cache keeps the ones fed back)
        self.first, self.last = 0.0, job.arrival  # perf_counter() of its first token (0: none yet) and its last
        self.pending: int | None = None
        self.muted = False  # replaying a token another worker already streamed: its events are not sent again

    def replay(self, token: int, generator_state: bytes = b"", logprobs: list[TokenLogprob] | None = None) -> str | None:
        """Take the first token a prefill worker chose and streamed (E -> P -> D): the sampler (its generator state
        as it was after that draw, the grammar, the penalty counts), detokenizer, stop rules and tool parser advance
        exactly as they did there, and nothing is sent again; `logprobs`: the token's, if its text was held back
        there (they go with the next delta here). Returns the finish reason if the token ended it."""
        if generator_state:
            self.sampler.generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
        self.muted = True
        try:
            reason = self.on_token(token)
        finally:
            self.muted = False
        if self.logprobs:
            self.entries = list(logprobs or [])
        return reason

    def on_token(self, token: int, logprobs: list[float] | None = None) -> str | None:
        """Take the token `sampler.choose` picked (read back by the caller, with `logprobs`: its sampler's packed
        logprobs, when the caller read them back too); returns the finish reason if done."""
        self.sampler.accept(token)  # a grammar that refuses it raises: this request fails
        self.generated.append(token)
        if self.logprobs and (entry := self.sampler.logprob_entry(token, logprobs)) is not None:
            self.entries.append(entry)
        now = time.perf_counter()
        if not self.muted:
            (self.metrics.ttft if self.num_generated == 0 else self.metrics.itl).observe(now - self.last)
        if self.num_generated == 0:
            self.first = now
        self.last, self.num_generated = now, self.num_generated + 1
        self.job.token_times.append(now)
        if self.echo:
            self._emit(Event(type="delta", index=self.index, text=self.echo))
            self.echo = ""
        if token in self.stop_ids:  # EOS or a stop_token_ids entry: not emitted, nor its logprobs
            if self.entries:
                self.entries.pop()
            return "stop"
        self._send(self.detok.add(token))
        if self.detok.stopped or (self.guide is not None and self.guide.terminated):
            return "stop"
        if self.max_tokens is not None and self.num_generated >= self.max_tokens:
            return "length"
        self.pending = token
        return None

    def finish(self, reason: str) -> None:
        """Flush held-back text (and tool calls), send `done` with usage (image tokens count as prompt tokens)."""
        if reason != "abort":
            self._send(self.detok.flush())
            if self.parser is not None:
                self._send("", final=True)
        if self.detok.stopped:  # the held-back tokens' text was cut with the stop string: so are their logprobs
            self.entries = []
        if reason == "stop" and self.parser is not None and self.parser.num_calls:
            reason = "tool_calls"
        prompt = self.job.prompt
        self.metrics.generated_tokens.inc(self.num_generated)
        if self.index == 0:  # n choices share one prompt: counted once
            self.metrics.prompt_tokens.inc(prompt.num_tokens)
        self.metrics.e2e.observe(time.perf_counter() - self.job.arrival)
        self.metrics.request_finished(self.job.arrival, self.job.admitted, self.first, self.last)
        usage = Usage(prompt_tokens=prompt.num_tokens, completion_tokens=self.num_generated,
                      total_tokens=prompt.num_tokens + self.num_generated,
                      num_image_tokens=sum(im.num_tokens for im in prompt.images),
                      cached_tokens=self.job.cached_tokens)
        # what is left: tokens that ended with no text of their own (a held-back last token), sent with `done`
        self.job.emit(Event(type="done", index=self.index, finish_reason=reason,  # type: ignore[arg-type]
                            usage=usage, logprobs=self._take_entries() or None))

    def _send(self, text: str, final: bool = False) -> None:
        """A delta with `text` (through the tool parser, if any) and the logprobs of the tokens behind it."""
        calls: list[ToolCallDelta] | None = None
        if self.parser is not None:
            parsed = self.parser.flush() if final else self.parser.feed(text)
            text, calls = parsed.content, parsed.calls or None
        if text or calls:
            self._emit(Event(type="delta", index=self.index, text=text, tool_calls=calls,
                             logprobs=self._take_entries()))

    def _emit(self, event: Event) -> None:
        if not self.muted:
            self.job.emit(event)

    def _take_entries(self) -> list[TokenLogprob] | None:
        if not self.logprobs:
            return None
        entries, self.entries = self.entries, []
        return entries
