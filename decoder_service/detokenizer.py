"""Incremental detokenization with stop strings: never emits broken UTF-8 or a stop string."""
from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # full decoded text so far (stop-truncated when stopped)
        self.num_emitted = 0  # chars of self.text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append a token; return the newly safe text (may be empty)."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its rest
            return ""
        self.text = text
        for s in self.stop:
            idx = text.find(s, max(0, self.num_emitted - len(s)))
            if idx != -1:
                self.text, self.stopped = text[:idx], True
                return self._emit(len(self.text))
        return self._emit(len(text) - self._held_back(text))

    def flush(self) -> str:
        return self._emit(len(self.text))

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
