"""What render() needs to know about a tokenizer, computed once: its added tokens, and the most characters
one token can cover (the cheap exact lower bound on a text's token count)."""
from __future__ import annotations

import json
import math
import re
import weakref
from dataclasses import dataclass
from typing import Any

from tokenizers.pre_tokenizers import ByteLevel

# NOTE: NFC/NFKC compose at most 4 code points into one (Unicode's maximum canonical decomposition, UAX #15),
# so the normalized text has at least len(text) / 4 characters; these normalizers never drop a character.
_NEVER_SHRINK = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_COMPOSE = {"NFC": 4, "NFKC": 4}
# pre-tokenizers that keep every character (Whitespace, BertPreTokenizer, ... drop some: no cheap bound there)
_KEEP_ALL = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTERS = {"Split", "Punctuation"}  # keep every character unless behavior is "Removed"
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class TokenizerFacts:
    added: dict[int, str]  # id -> content of every added or special token
    strip: tuple[tuple[str, bool, bool], ...]  # (content, lstrip, rstrip) of added tokens that swallow whitespace
    max_chars_per_token: int | None  # None: the pipeline may drop or fuse text, so no cheap bound exists
    unk_id: int | None = None  # the model makes it for unknown text: from text, only its own string counts

    def made_from(self, tid: int, text: str, start: int, end: int) -> bool:
        """Is token `tid`, covering text[start:end], an added token matched in that text?"""
        return tid in self.added and (tid != self.unk_id or self.added[tid] in text[start:end])

    @property
    def added_ids(self) -> frozenset[int]:
        return frozenset(self.added)

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(tokenize(text)), exact in the sense that no text of fewer tokens exceeds it.

        Cost: O(len(text)) time, no allocation beyond match objects (one pass over whitespace runs, only for
        tokenizers with lstrip/rstrip tokens). 0 when this tokenizer has no cheap bound.
        """
        if self.max_chars_per_token is None:
            return 0
        return math.ceil((len(text) - self._swallowed(text)) / self.max_chars_per_token)

    def _swallowed(self, text: str) -> int:
        """Whitespace an lstrip/rstrip added token could absorb (it covers the run, however long)."""
        if not self.strip:
            return 0
        total = 0
        for m in _WHITESPACE.finditer(text):
            a, b = m.span()
            if any((left and text.startswith(c, b)) or (right and text.endswith(c, 0, a))
                   for c, left, right in self.strip):
                total += b - a
        return total


_CACHE: weakref.WeakKeyDictionary[Any, TokenizerFacts] = weakref.WeakKeyDictionary()


def tokenizer_facts(tokenizer: Any) -> TokenizerFacts:
    """Computed once per tokenizer object (Qwen2's 150k vocab: a fraction of a second)."""
    facts = _CACHE.get(tokenizer)
    if facts is None:
        facts = _CACHE[tokenizer] = _compute(tokenizer)
    return facts


def _compute(tokenizer: Any) -> TokenizerFacts:
    decoder = tokenizer.added_tokens_decoder  # id -> AddedToken
    added = {int(i): str(t.content) for i, t in decoder.items()}
    for i in tokenizer.all_special_ids:
        added.setdefault(int(i), str(tokenizer.convert_ids_to_tokens(int(i))))
    strip = tuple((str(t.content), bool(t.lstrip), bool(t.rstrip)) for t in decoder.values() if t.lstrip or t.rstrip)
    unk = getattr(tokenizer, "unk_token_id", None)
    return TokenizerFacts(added=added, strip=strip, max_chars_per_token=_max_chars_per_token(tokenizer),
                          unk_id=int(unk) if unk is not None else None)


def _max_chars_per_token(tokenizer: Any) -> int | None:
    """Most input characters one token can stand for, or None when some text can vanish or fuse.

    A vocab entry's string is at least as long as the text it covers: byte-level strings have one character per
    byte, SentencePiece's "▁" stands for one space, byte-fallback "<0xE2>" for one byte. That holds only when the
    pipeline keeps every character and never fuses an unknown run into one token: checked here, else None.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    ratio = _normalizer_ratio(spec.get("normalizer"))
    vocab = tokenizer.get_vocab()
    if ratio is None or not _keeps_all(spec.get("pre_tokenizer")) or not _covers_all(spec, vocab):
        return None
    return max(len(t) for t in vocab) * ratio


def _normalizer_ratio(spec: dict[str, Any] | None) -> int | None:
    """How many input characters can shrink into one normalized character (None: unbounded, e.g. Strip)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        ratio = 1
        for part in spec.get("normalizers", []):
            r = _normalizer_ratio(part)
            if r is None:
                return None
            ratio *= r
        return ratio
    if kind in _NEVER_SHRINK:
        return 1
    if kind in _COMPOSE:
        return _COMPOSE[kind]
    if kind == "Replace" and "String" in spec.get("pattern", {}) and spec.get("content"):
        return max(1, math.ceil(len(spec["pattern"]["String"]) / len(spec["content"])))
    return None


def _keeps_all(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_all(p) for p in spec.get("pretokenizers", []))
    return kind in _KEEP_ALL or (kind in _SPLITTERS and spec.get("behavior") != "Removed")


def _covers_all(spec: dict[str, Any], vocab: dict[str, int]) -> bool:
    """Every character yields at least one token: byte-level alphabet, byte fallback, or unfused unknowns."""
    model = spec.get("model", {})
    if model.get("type") not in ("BPE", "Unigram"):
        return False  # WordPiece: a long word is one [UNK]; WordLevel: a word is one token, however long
    if model.get("byte_fallback"):
        return all(f"<0x{b:02X}>" in vocab for b in range(256))
    if _has_byte_level(spec.get("pre_tokenizer")):
        return all(c in vocab for c in ByteLevel.alphabet())
    return model.get("type") == "BPE" and model.get("unk_token") is not None and not model.get("fuse_unk")


def _has_byte_level(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in spec.get("pretokenizers", []))
    return bool(spec.get("type") == "ByteLevel")
