"""Keep user text ordinary: find which spans of a rendered prompt came from the request, and tokenize so that no
added or special token is ever made from them (a user cannot fake a system turn or an image placeholder).

How: the template is rendered with each user string replaced by a random sentinel, which marks where that string
lands; the sentinels are then filled back in. The filled prompt is tokenized in one call, exactly as before, and
kept unless an added token overlaps a user span; only then are the pieces between the template's own added
tokens re-encoded with special tokens split (the user's "<|im_start|>" becomes "<", "|", "im", ...).
"""
from __future__ import annotations

import bisect
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from epd_models.tokenizer_facts import TokenizerFacts

_KEEP = ("role", "type")  # chosen by the template's logic, not text it prints (roles are checked apart)
_BREAK = "\u200b"  # zero-width space: what the fallback inserts into a reserved string from the user


@dataclass(frozen=True)
class Marked:
    """Messages whose user strings are sentinels; `texts[i]` is what sentinel i stands for."""

    messages: list[dict[str, Any]]
    texts: list[str]
    pattern: re.Pattern[str]
    tools: list[Any] | None = None  # the request's tools, marked the same way

    def fill(self, rendered: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered prompt with user strings back in, and the (start, end) of each, in order."""
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = size = 0
        for m in self.pattern.finditer(rendered):
            pieces.append(rendered[pos:m.start()])
            size += m.start() - pos
            text = self.texts[int(m.group(1), 16)]
            pieces.append(text)
            spans.append((size, size + len(text)))
            size += len(text)
            pos = m.end()
        pieces.append(rendered[pos:])
        return "".join(pieces), spans

    def align(self, rendered: str, real: str) -> list[tuple[int, int]] | None:
        """The spans of the user strings in `real` (the render of the request itself), when the template printed
        each one either as is or JSON-escaped (`tojson`, as tools and tool arguments are) and all else is the
        same as in `rendered`; None when they cannot be matched that way."""
        spans: list[tuple[int, int]] = []
        pos = last = 0  # in real, in rendered
        for m in self.pattern.finditer(rendered):
            piece = rendered[last:m.start()]
            if not real.startswith(piece, pos):
                return None
            pos += len(piece)
            text = self.texts[int(m.group(1), 16)]
            form = next((f for f in (text, json.dumps(text, ensure_ascii=False)[1:-1]) if real.startswith(f, pos)),
                        None)
            if form is None:
                return None
            spans.append((pos, pos + len(form)))
            pos, last = pos + len(form), m.end()
        return spans if real[pos:] == rendered[last:] else None


def mark(messages: list[dict[str, Any]], facts: TokenizerFacts, tools: list[Any] | None = None) -> Marked:
    """Replace every non-empty string of the request (contents, text parts, names, tools) with a sentinel.

    Dict keys and `type` values stay as they are (templates look them up); in tools and tool calls, where they
    are the client's text (a parameter's name), one holding a reserved token's string is refused."""
    nonce = secrets.token_hex(8)
    texts: list[str] = []

    def walk(value: Any, key: str = "") -> Any:
        if isinstance(value, str):
            if key in _KEEP or not value:
                return value
            texts.append(value)
            return f"\ue000{nonce}{len(texts) - 1:x}\ue001"
        if isinstance(value, dict):
            return {k: walk(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    for msg in messages:
        _check_role(msg, facts)
        if isinstance(msg, dict) and msg.get("tool_calls"):
            _check_unmarked(msg["tool_calls"], facts)
    _check_unmarked(tools, facts)
    marked = [walk(m) for m in messages]
    marked_tools = None if tools is None else [walk(t) for t in tools]
    return Marked(marked, texts, re.compile("\ue000" + nonce + "([0-9a-f]+)\ue001"), marked_tools)


def _check_unmarked(value: Any, facts: TokenizerFacts, key: str = "") -> None:
    """Refuse a dict key or kept value (see _KEEP) that holds a reserved token's string."""
    if isinstance(value, str):
        if key in _KEEP and _reserved(value, facts):
            raise ValueError(f"{key} {value[:64]!r} contains a reserved token")
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and _reserved(k, facts):
                raise ValueError(f"the key {k[:64]!r} contains a reserved token")
            _check_unmarked(v, facts, k if isinstance(k, str) else "")
    elif isinstance(value, list):
        for v in value:
            _check_unmarked(v, facts)


def _reserved(text: str, facts: TokenizerFacts) -> bool:
    return any(c and c in text for c in facts.added.values())


def _check_role(msg: Any, facts: TokenizerFacts) -> None:
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ValueError("each message needs a string role")
    role = msg["role"]
    if _reserved(role, facts):
        raise ValueError(f"role {role[:64]!r} contains a reserved token")


def tokenize_isolated(tokenizer: Any, text: str, spans: list[tuple[int, int]], facts: TokenizerFacts) -> list[int]:
    """Token ids of `text` (exactly tokenizer(text) when no user span makes an added token) with none from a span."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    own: list[tuple[int, int, int]] = []  # (start, end, id): the template's own added tokens
    hostile = False
    for tid, (a, b) in zip(ids, enc["offset_mapping"], strict=True):
        if facts.made_from(tid, text, a, b):
            if overlaps(_core(text, a, b, facts.added[tid]), spans):
                hostile = True
            else:
                own.append((a, b, tid))
    if not hostile:
        return ids
    out: list[int] = []
    pos = 0
    for a, b, tid in own:
        out += encode_plain(tokenizer, text[pos:a], facts)
        out.append(tid)
        pos = b
    return out + encode_plain(tokenizer, text[pos:], facts)


def _core(text: str, a: int, b: int, content: str) -> tuple[int, int]:
    """Where the token's own string is (an lstrip/rstrip token's offsets include the whitespace it took)."""
    i = text.find(content, a, b)
    return (i, i + len(content)) if i >= 0 else (a, b)


def overlaps(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Does [start, end) share a character with any of the sorted, disjoint spans?"""
    start, end = span
    k = bisect.bisect_left(spans, (end,))  # spans[:k] start before `end`; spans[k - 1] ends last of them
    return k > 0 and spans[k - 1][1] > start


def encode_plain(tokenizer: Any, text: str, facts: TokenizerFacts) -> list[int]:
    """Ordinary tokens only: special tokens are split by the tokenizer, and a match of any other added token
    is cut after its first character and the pieces encoded apart, until none is left."""
    out: list[int] = []
    stack = [text]  # pieces still to encode, the next one last
    while stack:
        piece = stack.pop()
        if not piece:
            continue
        enc = tokenizer(piece, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
        bad = [(a, b) for tid, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
               if facts.made_from(tid, piece, a, b)]
        if not bad:
            out += enc["input_ids"]
            continue
        if any(b - a < 2 for a, b in bad):
            raise ValueError("the text contains a character this tokenizer reserves")
        cuts = [a + 1 for a, _ in bad]  # inside each match: neither side can form it again
        stack += reversed([piece[i:j] for i, j in zip([0, *cuts], [*cuts, len(piece)], strict=True)])
    return out


def defang(value: Any, facts: TokenizerFacts) -> Any:
    """The fallback's user strings: every reserved string broken by a zero-width space (benign text unchanged)."""
    if isinstance(value, dict):
        return {k: v if k in _KEEP else defang(v, facts) for k, v in value.items()}
    if isinstance(value, list):
        return [defang(v, facts) for v in value]
    if isinstance(value, str):
        for content in sorted(set(facts.added.values()), key=len, reverse=True):
            if len(content) > 1 and content in value:
                value = value.replace(content, content[0] + _BREAK + content[1:])
    return value


def count_added(ids: list[int], facts: TokenizerFacts) -> int:
    """Added tokens among `ids`, not counting the unknown token (unknown text makes it, not a reserved string)."""
    return sum(1 for i in ids if i in facts.added and i != facts.unk_id)
