"""The next-token choice for one sequence (penalties, greedy, temperature, top-k, top-p, seed).

The parameters are the contract the proxy validated (epd_contracts.sampling.SamplingParams);
for every value it admits and any logits row (NaN, +-inf, all equal, huge magnitudes) `choose` returns a
token and never raises, so one request's parameters cannot fail the batched step of the others.
"""
from __future__ import annotations

import torch

from epd_contracts.sampling import SamplingParams

_NEG_INF = float("-inf")


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
            self.generator.manual_seed(params.seed)  # the contract admits exactly manual_seed's range
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
        if p.greedy:  # argmax never raises (a NaN row is the model's fault; it still yields a token)
            return torch.argmax(logits)
        scores = _scaled(logits, p.temperature)
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, _NEG_INF)
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p, and always the most likely token
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            drop[0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0)  # not boolean indexing: that waits for the device
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=self.generator)[0]


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(logits - max) / temperature in float32: at most 0, and 0 somewhere, so softmax is always defined.

    NaN counts as impossible; +inf tokens share all the mass (the limit of softmax); a row with no finite
    maximum (all -inf or NaN) is uniform. Shifting first means a huge logit over a small temperature
    cannot overflow to +inf. All without a host sync (`torch.where`, not `if`).
    """
    x = torch.nan_to_num(logits.float(), nan=_NEG_INF, posinf=float("inf"), neginf=_NEG_INF)
    top = x.max()
    return torch.where(torch.isinf(top), torch.where(x == top, 0.0, _NEG_INF), (x - top) / temperature)
