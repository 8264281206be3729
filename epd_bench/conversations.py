"""epd-bench's multi-turn workload: conversations whose every turn resends the whole history.

A conversation is a system message (optional; the same in every conversation, as an application's
would be), images (and videos) in its first turn, and `turns` questions of random words. Turn k+1 sends the system
message, every earlier question and the assistant's actual answer to it, then its own question: what a
chat client sends, and what a prefix cache serves all but the new tail of. Conversations are
interleaved: at most `max_concurrency` are in flight, each sending its next turn as soon as the answer
to its previous one is complete; they start at the workload's arrival times. The questions, images and
lengths are a pure function of the spec and seed (the answers are the server's).
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from epd_bench.backends import RequestOutput, user_message
from epd_bench.dataset import (
    DatasetSpec,
    ImagePicker,
    SampleRequest,
    draw_length,
    pick_videos,
    random_words,
    system_prompt,
    video_picker,
)

# (a turn's sample, the messages before it) -> the finished request
SendTurn = Callable[[SampleRequest, tuple[dict[str, Any], ...]], Awaitable[RequestOutput]]


@dataclass(frozen=True)
class MultiTurnSpec:
    base: DatasetSpec  # input_len: words per question; output_len: max_tokens per turn; images: turn 1's
    conversations: int
    turns: int

    def __post_init__(self) -> None:
        assert self.conversations >= 0 and self.turns >= 1, "conversations >= 0 and turns >= 1"

    def to_json(self) -> dict[str, Any]:
        return {**self.base.__dict__, "conversations": self.conversations, "turns": self.turns}


@dataclass(frozen=True)
class Conversation:
    turns: tuple[SampleRequest, ...]  # turn 1 carries the images; every turn carries the system message

    def history(self, answers: list[str]) -> tuple[dict[str, Any], ...]:
        """The messages before turn len(answers) + 1: each earlier turn's question and its answer."""
        messages: list[dict[str, Any]] = []
        for turn, answer in zip(self.turns, answers, strict=False):
            messages += [user_message(turn), {"role": "assistant", "content": answer}]
        return tuple(messages)


def build_conversations(spec: MultiTurnSpec, num_warmups: int = 0) -> tuple[list[Conversation], list[Conversation]]:
    """(warm-up conversations of one turn, measured conversations). Warm-ups have their own images and
    system message, so they leave nothing in a cache that a measured turn could reuse."""
    base = spec.base
    rng = random.Random(base.seed)
    warm_picker = ImagePicker(base, random.Random(base.seed + 1), first_id=1_000_000_000)
    picker = ImagePicker(base, rng, first_id=0)

    videos = {True: video_picker(base, warm_up=True), False: video_picker(base, warm_up=False)}

    def conversation(p: ImagePicker, turns: int, warm_up: bool) -> Conversation:
        ids = p.pick(base.images_per_request, allow_repeats=False)
        media = pick_videos(videos[warm_up], warm_up=True)  # NOTE: no repeats: new videos, like its images
        samples = []
        for k in range(turns):
            words = random_words(rng, draw_length(rng, base.input_len, base.range_ratio))
            samples.append(SampleRequest(prompt=words, images=tuple(p.urls[i] for i in ids) if k == 0 else (),
                                         image_ids=ids if k == 0 else (), system=system_prompt(base, warm_up),
                                         output_len=draw_length(rng, base.output_len, base.range_ratio),
                                         **(media if k == 0 else {"video_frames": media.get("video_frames", 0)})))
        return Conversation(tuple(samples))

    warm = [conversation(warm_picker, 1, warm_up=True) for _ in range(num_warmups)]
    return warm, [conversation(picker, spec.turns, warm_up=False) for _ in range(spec.conversations)]


async def run_conversations(conversations: list[Conversation], offsets: list[float], max_concurrency: int | None,
                            send: SendTurn, on_done: Callable[[], None] = lambda: None,
                            ) -> tuple[list[RequestOutput], float]:
    """Run every conversation (each starts at its offset, waiting for one of max_concurrency slots); returns
    the outputs in (conversation, turn) order, and the duration. A failed turn ends its conversation: its
    later turns are recorded as failed, never sent (they would need the missing answer)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(conv: Conversation, offset: float) -> list[RequestOutput]:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if limit is not None:
            await limit.acquire()
        outputs: list[RequestOutput] = []
        try:
            for k, sample in enumerate(conv.turns):
                if outputs and not outputs[-1].success:
                    out = RequestOutput(error=f"not sent: turn {k} failed")
                else:
                    sent = time.perf_counter() - start
                    out = await send(sample, conv.history([o.generated_text for o in outputs]))
                    out.start_time = sent
                out.turn = k + 1
                outputs.append(out)
                on_done()
        finally:
            if limit is not None:
                limit.release()
        return outputs

    per_conv = await asyncio.gather(*(one(c, off) for c, off in zip(conversations, offsets, strict=True)))
    return [out for outs in per_conv for out in outs], time.perf_counter() - start
