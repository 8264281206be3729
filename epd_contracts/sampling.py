"""The sampling-parameters contract: the proxy builds it, the decoder receives it, the Sampler runs it.

Every value it admits is one the engine can run (tests/contracts/test_sampling.py drives the real Sampler with
the extremes); everything else is refused when it is decoded (epd_contracts.validation), with the field named.
A new sampling setting is one field here (and its use in decoder_service/engine/sampling.py). Torch-free.
"""
from __future__ import annotations

from typing import Annotated

import msgspec

from epd_contracts.validation import FieldError

# torch.Generator.manual_seed accepts exactly [-2**63, 2**64 - 1] (a negative seed s acts as s + 2**64);
# anything outside raises "Overflow when unpacking long long" (torch 2.13, CPU and CUDA share the binding)
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_TOP_K = 1 << 20  # above every real vocabulary (Gemma 3: 262,144); a larger top_k means no top-k anyway
MAX_TOKENS = 1 << 20  # the decoder also checks prompt + max_tokens against its context (Engine.prepare)
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # the detokenizer holds back up to this many characters while a stop may be forming
MAX_N = 128  # OpenAI's limit on choices per request; a decoder also refuses n above its --max-num-seqs
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (legacy completions: 5, checked by the proxy)
MAX_LOGIT_BIAS = 1024  # entries in logit_bias (OpenAI documents no limit; vLLM none; each entry costs a write)
MAX_STOP_TOKEN_IDS = 64
# vLLM's _SAMPLING_EPS: a temperature or top_p below it is numerically zero (1/temperature overflows float32
# at 1e-38; a top_p of 1e-46 is 0 in float32): such a request is greedy, never an error and never a crash
GREEDY_BELOW = 1e-5

# NOTE: msgspec bounds must fit in an int64, and MAX_SEED does not: the seed's range is checked in __post_init__
# (the schema still states it)
Seed = Annotated[int, msgspec.Meta(extra_json_schema={"minimum": MIN_SEED, "maximum": MAX_SEED})]
Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]  # bounded floats also refuse NaN and +-inf
TopP = Annotated[float, msgspec.Meta(ge=0, le=1)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=MAX_TOP_K)]  # 0 and -1 (vLLM's spelling) both mean off
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[tuple[StopString, ...], msgspec.Meta(max_length=MAX_STOP_STRINGS)]
N = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # the decoder checks it against its vocabulary
Bias = Annotated[float, msgspec.Meta(ge=-100, le=100)]  # OpenAI's range
LogitBias = Annotated[dict[TokenId, Bias], msgspec.Meta(max_length=MAX_LOGIT_BIAS)]
MinP = Annotated[float, msgspec.Meta(ge=0, le=1)]
StopTokenIds = Annotated[tuple[TokenId, ...], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)]


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """How one sequence chooses its tokens and when it stops."""

    max_tokens: MaxTokens | None = None  # None: up to the context (the decoder resolves it)
    temperature: Temperature = 1.0  # below GREEDY_BELOW: greedy
    top_p: TopP = 1.0  # below GREEDY_BELOW: greedy
    top_k: TopK = 0  # 0: off
    seed: Seed | None = None
    stop: StopStrings = ()
    ignore_eos: bool = False
    frequency_penalty: Penalty = 0.0  # OpenAI: minus this times how often a token was already generated
    presence_penalty: Penalty = 0.0  # OpenAI: minus this once a token has been generated at all
    n: N = 1  # choices sampled from one prefill; choice i seeds its generator with seed + i (mod 2**64)
    # None: no logprobs; k: each chosen token's logprob and the k most likely alternatives, from the distribution
    # after penalties, logit_bias and temperature (before top-k/top-p/min-p and grammar masks cut it)
    logprobs: TopLogprobs | None = None
    logit_bias: LogitBias = msgspec.field(default_factory=dict)  # token id -> added to its logit (OpenAI)
    min_p: MinP = 0.0  # vLLM: drop tokens whose probability is below min_p x the most likely one's
    stop_token_ids: StopTokenIds = ()  # vLLM: these tokens end the sequence (finish_reason "stop"), not emitted

    def __post_init__(self) -> None:
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise FieldError("seed", f"Expected `int` in [{MIN_SEED}, {MAX_SEED}] (what torch's manual_seed takes)")
        if self.top_k < 0:
            msgspec.structs.force_setattr(self, "top_k", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_p < GREEDY_BELOW or self.top_k == 1

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index` (n > 1): seed + index, wrapped into manual_seed's range."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index - MIN_SEED) % 2**64 + MIN_SEED

    @property
    def penalized(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """The same parameters with max_tokens resolved against the context (the decoder's Engine.prepare)."""
        assert max_tokens >= 1, "max_tokens is resolved to at least one token"
        return msgspec.structs.replace(self, max_tokens=max_tokens)
