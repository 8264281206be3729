"""The next-token choice for one sequence: penalties, logit_bias, logprobs, grammar mask, then the choice.

The parameters are the contract the proxy validated (epd_contracts.sampling.SamplingParams);
for every value it admits and any logits row (NaN, +-inf, all equal, huge magnitudes) `choose` returns a
token and never raises, so one request's parameters cannot fail the batched step of the others.

The order, per step:
1. penalties (frequency / presence, over the tokens chosen so far), then logit_bias (added, as OpenAI does);
2. logprobs, when asked for: log_softmax(x / T), T = 1 when greedy. So they describe the distribution after
   penalties, bias and temperature (as OpenAI documents) and before the grammar mask and the truncations
   (top-k, top-p, min-p) cut it: the chosen token always has a finite logprob, and the alternatives are the
   model's real preferences, not what the grammar happened to allow;
3. the guide's mask (structured outputs): disallowed tokens become impossible. The allowed set wins over
   everything else: when no allowed token has a usable logit the best allowed one is still chosen;
4. greedy argmax, or temperature -> min-p -> top-k -> top-p -> a draw from this choice's own generator.
Rows without a guide or logprobs pay nothing for them, and nothing here waits for the device.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from decoder_service.engine.logprobs import entry
from decoder_service.engine.outputs import RowLogits
from epd_contracts.sampling import SamplingParams

if TYPE_CHECKING:
    from decoder_service.engine.logprobs import TokenTable
    from epd_contracts.generate import TokenLogprob

_NEG_INF = float("-inf")
_LOWEST = torch.finfo(torch.float32).min


class Guide(Protocol):
    """What the sampler needs of a grammar matcher (decoder_service/grammar.py)."""

    def refused(self, vocab: int, device: torch.device) -> torch.Tensor: ...  # (vocab,) bool: refused tokens

    def accept(self, token: int) -> None: ...


class Sampler:
    """Chooses tokens for one sequence (one choice of a request); a seed makes the choice reproducible.

    Choice `index` of an n > 1 request seeds with params.choice_seed(index), so n seeded choices are each
    reproducible and differ from one another. Penalties count the tokens this sampler has chosen (the
    completion, not the prompt), as OpenAI defines them. `choose` works where the logits are and never waits
    for the device; the engine reads every row's choice back in one transfer and `accept`s it.
    """

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", *, index: int = 0,
                 guide: Guide | None = None, tokens: TokenTable | None = None):
        self.params, self.guide, self.tokens = params, guide, tokens
        self.counts: dict[int, int] = {}  # token id -> times chosen so far
        self.generator = torch.Generator(device=device)
        seed = params.choice_seed(index)
        if seed is not None:
            self.generator.manual_seed(seed)  # the contract admits exactly manual_seed's range
        else:
            self.generator.seed()
        # greedy with nothing of its own per step (penalties, bias, guide, logprobs): one row of a batched argmax
        self.plain_greedy = (params.greedy and not params.penalized and not params.logit_bias and guide is None
                             and (params.logprobs is None or tokens is None))
        self._bias: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (vocab, ids, values) on the device
        self._logprobs: torch.Tensor | None = None  # the last step's log_softmax row (logprobs asked for)
        self._packed: torch.Tensor | None = None  # the last choice's [token, logprob, top values, top ids]

    def __call__(self, logits: torch.Tensor) -> int:
        token = int(self.choose(logits))
        self.accept(token)
        return token

    def choose(self, logits: torch.Tensor, draft: int | None = None) -> torch.Tensor:
        """The next token as a 0-d tensor on the logits' device (no host sync). With `draft` (speculative decoding:
        a token proposed for this position), a sampled choice follows the rejection rule instead (`_verify`: one
        host sync); a greedy one is the argmax either way, and the caller compares it with the draft."""
        p = self.params
        if p.penalized and self.counts:
            logits = self._penalize(logits)
        if p.logit_bias:
            logits = self._add_bias(logits)
        scores = self._masked(logits) if self.guide is not None else logits
        token = self._choose(scores) if draft is None or p.greedy else self._verify(scores, draft)
        if p.logprobs is not None and self.tokens is not None:  # without the engine's TokenTable: no entries
            self._packed = self._pack(logits, token)
        return token

    def accept(self, token: int) -> None:
        """Count the chosen token for the penalties and advance the guide (which refuses a token it forbade)."""
        if self.params.penalized:  # nothing else reads the counts
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.guide is not None:
            self.guide.accept(token)

    @property
    def batched(self) -> bool:
        """Chosen in the step's batched argmax: plain greedy, and `choose` not replaced on this instance or by a
        subclass (a wrapper or an injected fault, as the engine's tests do, is still called)."""
        return self.plain_greedy and "choose" not in self.__dict__ and type(self).choose is Sampler.choose

    @property
    def packed(self) -> torch.Tensor | None:
        """The last choice's [token, logprob, top values, top ids] on the device (None without logprobs): the
        engine reads every row's back in one transfer and hands each its values (`logprob_entry(values=...)`)."""
        return self._packed

    def logprob_entry(self, token: int, values: list[float] | None = None) -> TokenLogprob | None:
        """The last chosen token's logprob and top alternatives (None when the request asked for none).

        `values`: `packed` already read back by the caller; without them this row reads its own back.
        """
        if self._packed is None or self._logprobs is None or self.tokens is None:
            return None
        k = (len(self._packed) - 2) // 2
        values = self._packed.tolist() if values is None else values
        chosen, logprob = int(values[0]), values[1]
        if chosen != token:  # the engine accepted another token than the one chosen here: look it up
            logprob = float(self._logprobs[token])
        top = [(int(i), lp) for lp, i in zip(values[2:2 + k], values[2 + k:], strict=True)]
        return entry(self.tokens, token, logprob, top)

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        ids = torch.tensor(list(self.counts)).to(logits.device, non_blocking=True)
        counts = torch.tensor(list(self.counts.values()), dtype=torch.float32).to(logits.device, non_blocking=True)
        logits = logits.float().clone()
        logits[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return logits

    def _add_bias(self, logits: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        if self._bias is None or self._bias[0] != vocab:  # built once; ids past the vocabulary are left out
            kept = {t: b for t, b in self.params.logit_bias.items() if t < vocab}
            ids = torch.tensor(list(kept), dtype=torch.long).to(logits.device, non_blocking=True)
            values = torch.tensor(list(kept.values()), dtype=torch.float32).to(logits.device, non_blocking=True)
            self._bias = (vocab, ids, values)
        _, ids, values = self._bias
        return logits.float().index_add(0, ids, values)  # out of place: the caller's logits stay as they were

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with every token the guide refuses at -inf: two ops on the row besides the guide's fill.

        An allowed token's NaN or -inf logit becomes the lowest finite float first, so it still ranks above every
        refused token: a row whose allowed logits are all unusable still chooses an allowed token (uniformly when
        sampling: they are all equal), without a host sync.
        """
        assert self.guide is not None
        refused = self.guide.refused(logits.shape[-1], logits.device)
        x = torch.nan_to_num(logits.float(), nan=_LOWEST, posinf=float("inf"), neginf=_LOWEST)
        return x.masked_fill(refused, _NEG_INF)

    def _pack(self, logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """[token, its logprob, k best logprobs, their ids] as one float32 row, read back by logprob_entry.

        Token ids are exact in float32 below 2**24, far above any vocabulary.
        """
        p = self.params
        assert p.logprobs is not None
        logprobs = torch.log_softmax(_scaled(logits, 1.0 if p.greedy else p.temperature), dim=-1)
        top = torch.topk(logprobs, min(p.logprobs, logprobs.numel()))
        index = token.view(1)  # gather, not logprobs[token]: indexing by a 0-d tensor reads it back
        self._logprobs = logprobs
        return torch.cat([index.float(), logprobs.gather(0, index), top.values, top.indices.float()])

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        if self.params.greedy:  # argmax never raises (a NaN row is the model's fault; it still yields a token)
            return torch.argmax(logits)
        return torch.multinomial(self._probs(logits), 1, generator=self.generator)[0]

    def _verify(self, logits: torch.Tensor, draft: int) -> torch.Tensor:
        """Speculative sampling with a deterministic proposal (q = 1 at `draft`): keep the draft with probability
        p(draft), else draw from p with the draft removed (max(0, p - q) normalized). The token is then distributed
        exactly as p (Leviathan et al. 2023, Chen et al. 2023), and a seed makes it reproducible."""
        probs = self._probs(logits)
        if draft < probs.numel():
            u = torch.rand((), generator=self.generator, device=probs.device)
            if bool(u < probs[draft]):
                return torch.tensor(draft, device=probs.device)
            rest = probs.clone()
            rest[draft] = 0
            if bool(rest.sum() > 0):
                return torch.multinomial(rest, 1, generator=self.generator)[0]
        return torch.multinomial(probs, 1, generator=self.generator)[0]

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution: temperature -> min-p -> top-k -> top-p."""
        p = self.params
        scores = _scaled(logits, p.temperature)
        if p.min_p > 0:  # vLLM: p < min_p * p_max, i.e. (with the maximum score at 0) score < log(min_p)
            scores = scores.masked_fill(scores < math.log(p.min_p), _NEG_INF)
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
        return probs


Batch = tuple[list[int], torch.Tensor]  # (row keys, their tokens as one 1-D tensor on the device)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax in one op over the (rows, vocab) logits (1-D, on their device, no host sync): exactly what
    `Sampler.choose` picks for a plain greedy row (the first maximum; a NaN counts as the maximum)."""
    return torch.argmax(logits, dim=-1)


def choose_rows(rows: list[tuple[int, Sampler]], logits: Mapping[Any, torch.Tensor]
                ) -> tuple[dict[int, torch.Tensor | Exception], Batch | None]:
    """Every row's next token on the device: the plain greedy rows in one batched argmax (`Batch`; over the forward's
    own logits matrix when `logits` is the runner's RowLogits), every other row by its own sampler (a 0-d tensor,
    or the exception its sampler raised: that row's failure alone)."""
    flagged = [(key, sampler, sampler.batched) for key, sampler in rows]
    plain = [key for key, _, batched in flagged if batched]
    batch: Batch | None = None
    if plain:
        try:
            stacked = logits.rows_of(plain) if isinstance(logits, RowLogits) else torch.stack([logits[k] for k in plain])
            batch = plain, greedy_tokens(stacked)
        except Exception:  # noqa: BLE001 - e.g. rows on different devices: each chooses alone below
            batch = None
    chosen: dict[int, torch.Tensor | Exception] = {}
    for key, sampler, batched in flagged:
        if batch is not None and batched:
            continue
        try:
            chosen[key] = sampler.choose(logits[key])
        except Exception as exc:
            chosen[key] = exc
    return chosen, batch


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(logits - max) / temperature in float32: at most 0, and 0 somewhere, so softmax is always defined.

    NaN counts as impossible; +inf tokens share all the mass (the limit of softmax); a row with no finite
    maximum (all -inf or NaN) is uniform. Shifting first means a huge logit over a small temperature
    cannot overflow to +inf. All without a host sync (`torch.where`, not `if`).
    """
    x = torch.nan_to_num(logits.float(), nan=_NEG_INF, posinf=float("inf"), neginf=_NEG_INF)
    top = x.max()
    return torch.where(torch.isinf(top), torch.where(x == top, 0.0, _NEG_INF), (x - top) / temperature)
