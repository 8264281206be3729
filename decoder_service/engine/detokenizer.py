"""Incremental detokenization with stop strings: never emits broken UTF-8 or a stop string."""
from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decodes only a short window per token (prefix/read offsets, as vLLM does), not the whole output."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
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
        decode = self.tokenizer.decode
        before = decode(self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        after = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=True)
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
