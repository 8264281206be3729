"""Tool calls out of a model's streamed text: content streams on, each complete call becomes one ToolCallDelta.

For formats that wrap each call in tags around a JSON object, Hermes/Qwen's `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` first. The result never depends on how the text was split into pieces: text that may be the
start of a tag is held back until the next piece decides, and a call is parsed only once its end tag has arrived.
"""
from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from epd_contracts.generate import ToolCallDelta


@dataclass(frozen=True)
class ParsedDelta:
    """What one piece of model text adds: content for the client, and the calls completed by this piece."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(ABC):
    """One per choice: feed() each piece of decoded text, flush() once at the end."""

    num_calls: int = 0

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta: ...

    @abstractmethod
    def flush(self) -> ParsedDelta: ...


class TaggedParser(ToolParser):
    """Calls are `begin` + JSON {"name": str, "arguments": object} + `end`.

    Whitespace just before a call, and at the end of an answer that made calls, is dropped (it only separates
    calls). A body that is not such an object is passed through as content, tags included; so is an unclosed call
    at the end, unless its body is a whole call (the model stopped right after the JSON).
    """

    def __init__(self, begin: str = "<tool_call>", end: str = "</tool_call>") -> None:
        self.begin, self.end = begin, end
        self._buf = ""  # text not yet given out
        self._inside = False  # after a begin tag, waiting for its end tag
        self._ws = ""  # trailing whitespace of the content so far: kept unless a call follows
        self._ws_before_call = ""  # what _ws held when the open call began (content again if it is malformed)
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._drain(final=False)

    def flush(self) -> ParsedDelta:
        delta = self._drain(final=True)
        tail, self._ws = ("" if self.num_calls else self._ws), ""
        return ParsedDelta(delta.content + tail, delta.calls)

    def _drain(self, final: bool) -> ParsedDelta:
        out: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if not self._inside:
                i = self._buf.find(self.begin)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self._buf, self.begin)
                    out.append(self._content(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out.append(self._content(self._buf[:i]))
                self._buf, self._inside = self._buf[i + len(self.begin):], True
                self._ws_before_call, self._ws = self._ws, ""
                continue
            j = self._buf.find(self.end)
            if j < 0 and not final:
                break
            closed = j >= 0
            body = self._buf[:j] if closed else self._buf
            self._buf, self._inside = (self._buf[j + len(self.end):] if closed else ""), False
            call = _parse_call(body)
            if call is None:
                raw = self.begin + body + (self.end if closed else "")
                out.append(self._content(self._ws_before_call + raw))
            else:
                calls.append(ToolCallDelta(index=self.num_calls, id="call_" + secrets.token_hex(12),
                                           name=call[0], arguments=call[1]))
                self.num_calls += 1
            self._ws_before_call = ""
        return ParsedDelta("".join(out), calls)

    def _content(self, text: str) -> str:
        """Content to give out now: held whitespace + text, less its own trailing whitespace (held instead)."""
        text = self._ws + text
        head = text.rstrip()
        self._ws = text[len(head):]
        return head


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (what must wait for more text)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, compact arguments JSON) of a call body, or None when it is not a call."""
    try:
        obj: Any = json.loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        return obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
