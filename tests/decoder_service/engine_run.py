"""Drive an Engine directly (no HTTP): submit prepared prompts together, collect each one's events."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from connector.tensors.consumer import ECConsumer
from decoder_service.config import DecoderConfig
from decoder_service.engine.sequence import Job
from decoder_service.metrics import DecoderMetrics
from decoder_service.prompt import Prompt, build_prompt
from decoder_service.shell import Engine
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.generate import Event
from epd_contracts.sampling import SamplingParams
from epd_models.chat import chat_template, render
from epd_models.halves import LanguageHalf


def make_engine(model_dir: Path, lm: LanguageHalf | None = None, **cfg: Any) -> Engine:
    """An engine on the tiny model with a large prefill budget (jobs submitted together run together)."""
    consumer = ECConsumer()
    cfg = {"max_num_seqs": 8, "max_prefill_tokens": 512, "max_model_len": 256, **cfg}
    return Engine(lm or LanguageHalf(model_dir), consumer, DecoderConfig(**cfg),
                  DecoderMetrics(CollectorRegistry(), consumer.stats))


def text_prompt(engine: Engine, words: int, images: list[ImageFeatures] | None = None) -> Prompt:
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in images or []]
    text = " ".join(["describe the picture"] * words)
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    return build_prompt(engine.lm, render(engine.lm.tokenizer, messages, chat_template(engine.lm.tokenizer,
                                                                                       engine.lm.model_dir)),
                        images or [])


def greedy(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


@dataclass
class Result:
    text: str = ""
    events: list[Event] = field(default_factory=list)

    @property
    def last(self) -> Event:
        return self.events[-1]

    @property
    def ok(self) -> bool:
        return self.last.type == "done"

    def answer(self) -> tuple[str, str | None, int | None]:
        """What must be identical between a solo run and a run beside a failing request."""
        usage = self.last.usage
        return self.text, self.last.finish_reason, usage.completion_tokens if usage else None


async def collect(job: Job, timeout: float = 60.0) -> Result:
    out = Result()
    while True:
        event = await asyncio.wait_for(job.events.get(), timeout)
        out.events.append(event)
        if event.type == "delta":
            out.text += event.text
        else:
            return out


def run(engine: Engine, specs: list[tuple[Prompt, SamplingParams]],
        after_submit: Callable[[list[Job]], None] | None = None) -> list[Result]:
    """Submit every spec at once (they join the same steps), return each one's events."""

    async def main() -> list[Result]:
        jobs = [engine.submit(prompt, params) for prompt, params in specs]
        if after_submit is not None:
            after_submit(jobs)
        return list(await asyncio.gather(*(collect(job) for job in jobs)))

    return asyncio.run(main())


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False
