"""Incremental detokenization with stop strings: never emits broken UTF-8 or a stop string."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend


def _plain_rust(tokenizer: Any) -> bool:
    """A fast tokenizer whose transformers wrapper adds nothing to the Rust decoder (no overridden decoding, no
    clean-up of spaces)."""
    cls = type(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces)


def window_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, straight to the Rust tokenizer where transformers' wrapper
    adds nothing to it: 0.45 us a call instead of 3.2 us on the bench model's tokenizer."""
    if _plain_rust(tokenizer):
        return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Decodes only a short window per token, not the whole output: the Rust tokenizer's own `DecodeStream` where
    the wrapper adds nothing (one call per token, 0.9 us against 3.6 us for two window decodes on the ten families'
    tokenizers; vLLM's fast path), else prefix/read offsets over `tokenizer.decode` (vLLM's slow path)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.decode = window_decoder(tokenizer)
        self._rust = tokenizer.backend_tokenizer if _plain_rust(tokenizer) else None
        self._stream = DecodeStream(skip_special_tokens=True) if self._rust is not None else None
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # decoded text so far (stop-truncated once stopped)
        self.num_emitted = 0  # chars of self.text already handed out
        self.stopped = False
        # token_ids[prefix_offset:read_offset] is already in self.text; decoding from prefix_offset
        # keeps a little left context so merges across token boundaries decode right
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        """Append a token; return the newly safe text (may be empty)."""
        self.token_ids.append(token_id)
        self.text += self._delta()
        for s in self.stop:
            idx = self.text.find(s, max(0, self.num_emitted - len(s)))
            if idx != -1:
                self.text, self.stopped = self.text[:idx], True
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back(self.text))

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _delta(self) -> str:
        if self._stream is not None and self._rust is not None:
            return self._stream.step(self._rust, self.token_ids[-1]) or ""
        before = self.decode(self.token_ids[self.prefix_offset : self.read_offset])
        after = self.decode(self.token_ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):  # nothing new, or a partial character
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return str(after[len(before) :])

    def _held_back(self, text: str) -> int:
        """Chars at the end of text that could start a stop string."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    held = max(held, n)
                    break
        return held

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.num_emitted)
        out, self.num_emitted = self.text[self.num_emitted : upto], upto
        return out
