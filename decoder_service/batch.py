"""Prefill in chunks into free slots and decode every running sequence in one batched forward."""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from decoder_service.prompt import Prompt
from decoder_service.slots import Plan, SlotCache
from models.halves import LanguageHalf


@dataclass
class Row:
    key: Hashable
    prompt: Prompt
    embeds: torch.Tensor  # (1, L, hidden) prompt embeddings, images merged
    positions: torch.Tensor  # prompt positions: (1, L), or (3, 1, L) for M-RoPE
    rope_delta: int
    length: int = 0  # positions written into the slot

    @property
    def prefilled(self) -> bool:
        return self.length >= self.prompt.num_tokens


class BatchRunner:
    """Sequences live in slots 0..n-1 (packed); callers choose tokens and decide when a sequence ends."""

    def __init__(self, lm: LanguageHalf, max_slots: int, max_len: int, chunk: int = 64):
        self.lm, self.chunk = lm, chunk
        dtype = next(lm.module.parameters()).dtype
        self.cache = SlotCache(lm.config.get_text_config(), max_slots, max_len, dtype, lm.device)
        self.rows: list[Row] = []  # index == slot

    @property
    def is_full(self) -> bool:
        return len(self.rows) >= self.cache.max_slots

    @property
    def num_prefill_tokens_left(self) -> int:
        """Prompt tokens admitted but not prefilled yet."""
        return sum(r.prompt.num_tokens - r.length for r in self.rows if not r.prefilled)

    @torch.inference_mode()
    def add(self, key: Hashable, prompt: Prompt) -> None:
        assert not self.is_full, "no free slot"
        assert prompt.num_tokens < self.cache.max_len, "prompt does not fit the cache"
        positions, delta = self.lm.position_ids(prompt.input_ids, prompt.images)
        self.rows.append(Row(key, prompt, self.lm.embed(prompt.input_ids, prompt.images), positions, delta))

    @torch.inference_mode()
    def prefill(self, budget: int) -> dict[Hashable, torch.Tensor]:
        """Prefill up to `budget` prompt tokens, chunk by chunk; returns last logits of prompts now complete."""
        done: dict[Hashable, torch.Tensor] = {}
        for slot, row in enumerate(self.rows):
            while not row.prefilled and budget > 0:
                n = min(self.chunk, budget, row.prompt.num_tokens - row.length)
                start, end = row.length, row.length + n
                mask = self.cache.set_plan(Plan(slice(slot, slot + 1), [start], n))
                logits = self.lm.forward_rows(row.embeds[:, start:end], row.positions[..., start:end], self.cache, mask)
                row.length, budget = end, budget - n
                if row.prefilled:
                    done[row.key] = logits[0]
        return done

    @torch.inference_mode()
    def decode(self, tokens: dict[Hashable, int]) -> dict[Hashable, torch.Tensor]:
        """Feed one token to every prefilled row (all of them must be given one); returns next logits."""
        rows = [r for r in self.rows if r.prefilled]
        assert rows == self.rows[: len(rows)] and set(tokens) == {r.key for r in rows}, "decode every prefilled row"
        if not rows:
            return {}
        ids = torch.tensor([[tokens[r.key]] for r in rows])  # host tensors; embed / to_device move them
        positions = torch.cat([self.lm.adapter.decode_position_ids(r.length, r.rope_delta) for r in rows], dim=-2)
        positions = self.lm.to_device(positions)
        mask = self.cache.set_plan(Plan(slice(0, len(rows)), [r.length for r in rows], 1))
        logits = self.lm.forward_rows(self.lm.embed(ids, []), positions, self.cache, mask)
        for r in rows:
            r.length += 1
        return {r.key: logits[i] for i, r in enumerate(rows)}

    def remove(self, key: Hashable) -> None:
        """Free a sequence's slot, keeping rows packed as [prefilled..., still prefilling...]."""
        hole = next(i for i, r in enumerate(self.rows) if r.key == key)
        num_prefilled = sum(r.prefilled for r in self.rows)
        if hole < num_prefilled:  # the last prefilled row fills it, leaving the hole at the group's end
            self._move(num_prefilled - 1, hole)
            hole = num_prefilled - 1
        self._move(len(self.rows) - 1, hole)
        self.rows.pop()

    def _move(self, src: int, dst: int) -> None:
        if src != dst:
            self.cache.move(src, dst, self.rows[src].length)
            self.rows[dst] = self.rows[src]
