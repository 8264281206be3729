"""The n choices of one answer, assembled from the decoder's interleaved events (choice `index` on each).

Each choice gathers its text, its tokens' logprobs, its tool calls (the decoder streams them as OpenAI does:
the first piece of call k has its id and name, later pieces more of its arguments' JSON text) and its finish
reason; the answer's usage counts the prompt once and the completion tokens of every choice (as OpenAI does).
"""
from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from epd_common.errors import APIError, bad_request
from epd_contracts.generate import Event, TokenLogprob, ToolCallDelta, Usage

if TYPE_CHECKING:
    from proxy.worker_state import Worker


def check_n(n: int | None, decoders: Iterable[Worker]) -> None:
    """`n` above the largest --max-num-seqs the decoders report on /health could never run (its choices take their
    rows in waves, but a prefill worker's hand-off takes n at once): a 400 naming the limit, before any media is
    fetched or encoded. Decoders that do not say are not counted (the decoder refuses it then)."""
    limits = [m for w in decoders if isinstance(m := w.info.get("max_num_seqs"), int) and not isinstance(m, bool)
              and m > 0]
    if n is not None and limits and n > max(limits):
        raise bad_request(f"n ({n}) exceeds the decoders' --max-num-seqs ({max(limits)})", param="n")


@dataclass
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # call index -> OpenAI's tool call
    finish_reason: str | None = None  # the decoder's, once done
    usage: Usage | None = None

    def add(self, ev: Event) -> None:
        self.logprobs.extend(ev.logprobs or ())  # `done` carries those of tokens that ended with no text
        if ev.type == "done":
            self.finish_reason, self.usage = ev.finish_reason or "stop", ev.usage
            return
        self.text.append(ev.text)
        for delta in ev.tool_calls or ():
            call = self.calls.setdefault(delta.index, {"id": "", "type": "function",
                                                       "function": {"name": "", "arguments": ""}})
            call["id"] = call["id"] or delta.id or ""
            call["function"]["name"] += delta.name or ""
            call["function"]["arguments"] += delta.arguments

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls in order; a call the decoder sent without an id gets one (OpenAI's ids are opaque)."""
        return [{**c, "id": c["id"] or f"call_{uuid.uuid4().hex[:24]}"} for _, c in sorted(self.calls.items())]


class Choices:
    """All n choices of one answer; `add` refuses an event for a choice that does not exist (a decoder bug)."""

    def __init__(self, n: int = 1):
        self.n = n
        self.by_index: dict[int, Choice] = {}

    def add(self, ev: Event) -> Choice:
        if not 0 <= ev.index < self.n:
            raise APIError(502, f"the decoder sent choice {ev.index} of a request for {self.n}", code="upstream_error")
        choice = self.by_index.setdefault(ev.index, Choice(ev.index))
        choice.add(ev)
        return choice

    @property
    def finished(self) -> bool:
        return len(self.by_index) == self.n and all(c.finish_reason is not None for c in self.by_index.values())

    def in_order(self) -> list[Choice]:
        return [self.by_index.get(i) or Choice(i) for i in range(self.n)]

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: the prompt once, every choice's completion tokens, the prompt tokens served from cache."""
        done = [c.usage for c in self.by_index.values() if c.usage is not None]
        assert done, "a done event carries usage"
        prompt, completion = done[0].prompt_tokens, sum(u.completion_tokens for u in done)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": max(u.cached_tokens for u in done)}}


def chat_finish_reason(reason: str | None) -> str:
    # NOTE: "abort" only happens when the client is gone; nobody reads it
    return reason if reason in ("length", "tool_calls") else "stop"


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's choice logprobs: a ChatCompletionTokenLogprob per token (`bytes` and `top_logprobs` included)."""
    return {"content": [msgspec.to_builtins(e) for e in entries], "refusal": None}


def tool_call_chunks(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """Streamed tool-call pieces as OpenAI sends them: id, type and name on a call's first piece only."""
    out = []
    for d in deltas:
        head: dict[str, Any] = {"id": d.id, "type": "function"} if d.id else {}
        function = {"name": d.name, "arguments": d.arguments} if d.name else {"arguments": d.arguments}
        out.append({"index": d.index, **head, "function": function})
    return out


def legacy_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """/v1/completions' logprobs: tokens, their logprobs, a {token: logprob} of the alternatives each, and each
    token's character offset in the choice's text (starting at `offset`)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries], "text_offset": offsets}
