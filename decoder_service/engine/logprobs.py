"""Logprobs as OpenAI sends them: each token's text and real UTF-8 bytes, and the entry for one chosen token.

A token can be half of a character (byte-level BPE splits "é" or an emoji across tokens): its `token` text then
holds U+FFFD, while `bytes` holds its real bytes, so a client that joins the bytes of a sequence's tokens gets
the exact UTF-8 of the text. Two tokenizer families store those bytes differently:
- byte-level BPE (GPT-2, Llama-3, Qwen, ours in epd_builders/tokenizer.py): each token string is its bytes
  spelled through GPT-2's byte <-> unicode table ("Ġ" is a space, "Ċ" a newline);
- sentencepiece with byte fallback (Llama-2, Gemma, Mistral): "▁" is a space and `<0xE2>` is one raw byte.
Added and special tokens are stored as their plain text in both.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from epd_contracts.generate import TokenLogprob, TopLogprob

NEG_LOGPROB = -9999.0  # what OpenAI sends for a logprob of -inf (the JSON has no infinity)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"  # sentencepiece's "▁"


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """GPT-2's table, inverted: the printable stand-in character of each byte -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:  # the rest are shifted past 255, in byte order
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenTable:
    """Per-token text and UTF-8 bytes of one tokenizer, built once per engine and filled in lazily per id."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added: set[int] = {int(i) for i in added}  # stored as plain text, not through the byte table
        self._cache: dict[int, tuple[str, list[int]]] = {}  # token id -> (text, bytes)

    def text(self, token: int) -> str:
        return self._entry(token)[0]

    def bytes(self, token: int) -> list[int]:
        return self._entry(token)[1]

    def _entry(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            hit = self._cache[token] = self._build(token)
        return hit

    def _build(self, token: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if token in self.added or not isinstance(piece, str):
            return text, list(text.encode("utf-8"))
        if self.byte_level:
            table = unicode_to_byte()
            if all(c in table for c in piece):
                return text, [table[c] for c in piece]
            return text, list(text.encode("utf-8"))  # not spelled through the table: an added token in disguise
        byte = _BYTE_TOKEN.fullmatch(piece)
        raw = bytes([int(byte.group(1), 16)]) if byte else piece.replace(_SPACE, " ").encode("utf-8")
        # sentencepiece's decoder strips a leading space of the sequence: the text follows the bytes instead
        return raw.decode("utf-8", errors="replace"), list(raw)


def _is_byte_level(tokenizer: Any) -> bool:
    if hasattr(tokenizer, "byte_decoder"):  # a slow GPT-2 / Qwen2 tokenizer keeps the table itself
        return True
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


def finite(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (and a NaN, which should not happen) become -9999.0."""
    return logprob if logprob > NEG_LOGPROB else NEG_LOGPROB


def top_entry(tokens: TokenTable, token: int, logprob: float) -> TopLogprob:
    return TopLogprob(token=tokens.text(token), logprob=finite(logprob), bytes=tokens.bytes(token))


def entry(tokens: TokenTable, token: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
    """The chosen token's entry; `top` is (token id, logprob) of the k best alternatives, best first."""
    return TokenLogprob(token=tokens.text(token), logprob=finite(logprob), bytes=tokens.bytes(token),
                        top_logprobs=[top_entry(tokens, t, lp) for t, lp in top])
