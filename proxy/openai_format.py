"""Building OpenAI chat-completion objects and SSE frames."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from epd_contracts.generate import Event
from proxy.choices import Choices, chat_finish_reason, chat_logprobs, tool_call_chunks


@dataclass(frozen=True)
class Completion:
    """One chat answer's objects: its chunks while streaming, or the whole chat.completion."""

    model: str
    logprobs: bool = False  # the request asked for logprobs: each choice has them (else `logprobs` is null)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None, index: int = 0,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        """Each choice's first chunk carries the role."""
        return [self.chunk({"role": "assistant", "content": ""}, index=i) for i in range(n)]

    def delta_chunk(self, ev: Event) -> dict[str, Any] | None:
        delta: dict[str, Any] = {"content": ev.text} if ev.text or not ev.tool_calls else {}
        if ev.tool_calls:
            delta["tool_calls"] = tool_call_chunks(ev.tool_calls)
        if not ev.text and not ev.tool_calls and not ev.logprobs:
            return None
        return self.chunk(delta, index=ev.index, logprobs=chat_logprobs(ev.logprobs) if ev.logprobs else None)

    def finish_chunk(self, ev: Event) -> dict[str, Any]:
        """The choice's last chunk, with the logprobs of tokens that ended with no text (a held-back last token)."""
        return self.chunk({}, chat_finish_reason(ev.finish_reason), index=ev.index,
                          logprobs=chat_logprobs(ev.logprobs) if ev.logprobs else None)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": usage}

    def response(self, choices: Choices) -> dict[str, Any]:
        out = []
        for c in choices.in_order():
            text, calls = "".join(c.text), c.tool_calls()
            message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None,
                                       "refusal": None}
            if calls:
                message["tool_calls"] = calls
            out.append({"index": c.index, "message": message, "finish_reason": chat_finish_reason(c.finish_reason),
                        "logprobs": chat_logprobs(c.logprobs) if self.logprobs else None})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": out, "usage": choices.usage()}


def sse(obj: dict[str, Any] | str) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
