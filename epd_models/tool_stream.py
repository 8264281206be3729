"""Tool calls out of a model's streamed text: content streams on, each call streams as OpenAI streams one.

For formats that wrap each call in tags around a JSON object, Hermes/Qwen's `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` first. A call's first ToolCallDelta has its index, id and name; the next ones of that index carry
the next characters of its arguments' JSON text, exactly as the model wrote it. The result (content, and each call's
name and joined arguments) never depends on how the text was split into pieces: text that may be the start of a tag,
or the end of a call, is held back until the next piece decides.
"""
from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from epd_contracts.generate import ToolCallDelta

_WS = " \t\n\r"  # JSON's whitespace
_SKIP_WS = re.compile(r"[ \t\n\r]*")
# a JSON string, or the start of one (`\Z`: the text ends inside it); json.loads checks a closed one
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*("|\\?\Z)')
# a call's head, None standing for its name (a JSON string); JSON whitespace may come before each token
_HEAD = ("{", '"name"', ":", None, ",", '"arguments"', ":", "{")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedDelta:
    """What one piece of model text adds: content for the client, and the tool-call pieces (ToolCallDelta)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(ABC):
    """One per choice: feed() each piece of decoded text, flush() once at the end. num_calls: calls begun so far."""

    num_calls: int = 0

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta: ...

    @abstractmethod
    def flush(self) -> ParsedDelta: ...


class TaggedParser(ToolParser):
    """Calls are `begin` + JSON {"name": str, "arguments": object} + `end`.

    A call whose body starts with a head `{"name": "<name>", "arguments": {` (JSON whitespace allowed between
    tokens, the name a complete non-empty JSON string) streams, as vLLM's and SGLang's Hermes parsers do: the head
    gives the first delta (index, id, name, arguments ""), then each piece of text the next characters of the
    arguments, from their `{` on, less a tail that may still be the end of the call (whitespace, the wrapper's `}`,
    a start of `end`), held until the next piece decides. At `end` the arguments are the text between the head and
    the wrapper's final `}`, trimmed. When that text is not JSON followed by `}` (a key after the arguments, a
    missing `}`, broken JSON), the call stays a call, its pieces being out: its arguments are all of its text up to
    `end`, trimmed. A streamed call still open at the end is closed the same way with all the text it has; a
    start of `end` at its very end is dropped when the text before it is a whole call (the answer was cut off
    inside the end tag), else kept.

    Any other body waits for `end` and is then one delta if it is a whole call (its keys in any order, "parameters"
    for "arguments", the arguments an object or a JSON string holding one), its arguments the model's text of them
    (trimmed; the string's content); else it is passed through as content, tags included. So is an unclosed one at
    the end, unless its body is a whole call (the model stopped right after the JSON).

    Whitespace just before a call, and at the end of an answer that made calls, is dropped (it only separates
    calls).
    """

    def __init__(self, begin: str = "<tool_call>", end: str = "</tool_call>") -> None:
        self.begin, self.end = begin, end
        self._buf = ""  # text not yet given out (in a streamed call: from its arguments' first unsent character)
        self._inside = False  # after a begin tag, waiting for its end tag
        self._streaming = False  # inside, the call's head given out: its arguments stream
        self._headless = False  # inside, the body cannot start with a head: the call waits for its end tag
        self._sent: list[str] = []  # the streamed call's arguments given out so far
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
                self._streaming = self._headless = False
                self._ws_before_call, self._ws = self._ws, ""
                continue
            j = self._buf.find(self.end)
            closed = j >= 0
            body = self._buf[:j] if closed else self._buf
            if self._streaming:
                if not closed and not final:
                    self._stream_safe_part(calls)
                    break
                sent = "".join(self._sent)
                keep = 0 if closed else _partial_suffix(body, self.end)
                if keep and _unwrapped(sent + body[:-keep]) is not None:  # cut off inside its end tag
                    body = body[:-keep]
                self._argument_piece(calls, _streamed_arguments(sent + body)[len(sent):])
                self._close(j)
                continue
            if not self._headless:
                head = _head(body)
                if isinstance(head, tuple):  # the head is in the body: the call streams from here
                    name, arguments_at = head
                    calls.append(ToolCallDelta(index=self.num_calls, id=_call_id(), name=name, arguments=""))
                    self.num_calls += 1
                    self._buf, self._streaming, self._sent = self._buf[arguments_at:], True, []
                    continue
                self._headless = not head
            if not closed and not final:
                break
            call = _parse_call(body)
            if call is None:
                raw = self.begin + body + (self.end if closed else "")
                out.append(self._content(self._ws_before_call + raw))
            else:
                calls.append(ToolCallDelta(index=self.num_calls, id=_call_id(), name=call[0], arguments=call[1]))
                self.num_calls += 1
            self._close(j)
        return ParsedDelta("".join(out), calls)

    def _stream_safe_part(self, calls: list[ToolCallDelta]) -> None:
        """Give out the streamed call's arguments so far, less a tail that may still end the call."""
        keep = _partial_suffix(self._buf, self.end)
        safe = self._buf[:len(self._buf) - keep].rstrip(_WS)
        if safe.endswith("}"):
            safe = safe[:-1].rstrip(_WS)
        self._argument_piece(calls, safe)
        self._buf = self._buf[len(safe):]

    def _argument_piece(self, calls: list[ToolCallDelta], text: str) -> None:
        if text:
            calls.append(ToolCallDelta(index=self.num_calls - 1, arguments=text))
            self._sent.append(text)

    def _close(self, j: int) -> None:
        """The open call is done: the text after its end tag (at `j`; -1: at the end of the answer) comes next."""
        self._buf = self._buf[j + len(self.end):] if j >= 0 else ""
        self._inside = self._streaming = self._headless = False
        self._sent, self._ws_before_call = [], ""

    def _content(self, text: str) -> str:
        """Content to give out now: held whitespace + text, less its own trailing whitespace (held instead)."""
        text = self._ws + text
        head = text.rstrip()
        self._ws = text[len(head):]
        return head


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (what must wait for more text)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _head(body: str) -> tuple[str, int] | bool:
    """(name, where the arguments' `{` is) when `body` starts with a call head; True while `body` may still grow
    into one, False when it cannot."""
    i, name = 0, ""
    for token in _HEAD:
        i = _skip_ws(body, i)
        if i == len(body):
            return True
        if token is None:
            m = _STRING.match(body, i)
            if m is None:
                return False
            if not m.group(1):  # the body ends inside the name
                return True
            try:
                name = json.loads(m.group())
            except ValueError:  # a bad escape
                return False
            if not name:
                return False
            i = m.end()
            continue
        if body.startswith(token, i):
            i += len(token)
        else:
            return len(body) - i < len(token) and token.startswith(body[i:])
    return name, i - 1


def _streamed_arguments(text: str) -> str:
    """The arguments of a streamed call whose text after its head is `text`: all but the wrapper's final `}` when
    what precedes it is JSON, else (a malformed call) all of it; trimmed either way."""
    inner = _unwrapped(text)
    return text.rstrip(_WS) if inner is None else inner


def _unwrapped(text: str) -> str | None:
    """The JSON before the wrapper's final `}` when `text` (trimmed) is that JSON followed by `}`, else None."""
    text = text.rstrip(_WS)
    if not text.endswith("}"):
        return None
    inner = text[:-1].rstrip(_WS)
    try:
        json.loads(inner)
    except (ValueError, RecursionError):
        return None
    return inner


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text as the model wrote it) of a call body, or None when it is not a call."""
    try:
        obj: Any = json.loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        key = next((k for k in ("arguments", "parameters") if k in obj), None)
        if key is None:
            return obj["name"], "{}"
        args = obj[key]
        if isinstance(args, str):  # some models write the arguments as a JSON string
            text = args.strip(_WS)
            args = json.loads(text)
        else:
            text = _member_text(body, key)
        if not isinstance(args, dict):
            return None
        return obj["name"], text
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None


def _member_text(body: str, key: str) -> str:
    """The text of member `key`'s value (its last, as json.loads keeps) in `body`, the text of a JSON object."""
    text, i = "", _skip_ws(body, _skip_ws(body, 0) + 1)  # past the `{`
    while body[i] != "}":
        name, i = _DECODER.raw_decode(body, i)
        i = _skip_ws(body, _skip_ws(body, i) + 1)  # past the `:`
        end = _DECODER.raw_decode(body, i)[1]
        if name == key:
            text = body[i:end]
        i = _skip_ws(body, end)
        if body[i] == ",":
            i = _skip_ws(body, i + 1)
    return text


def _skip_ws(text: str, i: int) -> int:
    return _SKIP_WS.match(text, i).end()  # type: ignore[union-attr]  # `*` always matches
