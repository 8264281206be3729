"""Building OpenAI chat-completion objects and SSE frames."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from epd_contracts.generate import Usage


@dataclass(frozen=True)
class Completion:
    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": usage}

    def response(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
                "usage": usage}


def openai_usage(usage: Usage | None) -> dict[str, int]:
    assert usage is not None, "a done event carries usage"
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def openai_finish_reason(reason: str | None) -> str:
    # NOTE: "abort" only happens when the client is gone; nobody reads it
    return "length" if reason == "length" else "stop"


def sse(obj: dict[str, Any] | str) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
