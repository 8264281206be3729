"""Sampling parameters and the next-token choice (penalties, greedy, temperature, top-k, top-p, seed)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often a token was already generated
    presence_penalty: float = 0.0  # OpenAI: minus this once a token has been generated at all

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (-2 <= self.frequency_penalty <= 2 and -2 <= self.presence_penalty <= 2):
            raise ValueError("frequency_penalty and presence_penalty must be in [-2, 2]")

    @property
    def penalized(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """Chooses tokens for one sequence; a seed makes the choice reproducible (per device type).

    Penalties count the tokens this sampler has chosen (the completion, not the prompt), as OpenAI
    defines them, and apply before the greedy or random choice. `choose` works where the logits are and
    never waits for the device; the engine reads every row's choice back in one transfer and `accept`s it.
    """

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.counts: dict[int, int] = {}  # token id -> times chosen so far
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        token = int(self.choose(logits))
        self.accept(token)
        return token

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token as a 0-d tensor on the logits' device (no host sync)."""
        return self._choose(self._penalize(logits) if self.params.penalized and self.counts else logits)

    def accept(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        ids = torch.tensor(list(self.counts)).to(logits.device, non_blocking=True)
        counts = torch.tensor(list(self.counts.values()), dtype=torch.float32).to(logits.device, non_blocking=True)
        logits = logits.float().clone()
        logits[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return logits

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.greedy:
            return torch.argmax(logits)
        logits = logits.float() / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0)  # not boolean indexing: that waits for the device
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=self.generator)[0]
