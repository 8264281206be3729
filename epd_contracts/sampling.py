"""The sampling-parameters contract: the proxy builds it, the decoder receives it, the Sampler runs it.

Every value it admits is one the engine can run (tests/contracts/test_sampling.py drives the real Sampler with
the extremes); everything else is refused when it is decoded (epd_contracts.validation), with the field named.
A new sampling setting is one field here (and its use in decoder_service/sampling.py). Torch-free.
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

    def __post_init__(self) -> None:
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise FieldError("seed", f"Expected `int` in [{MIN_SEED}, {MAX_SEED}] (what torch's manual_seed takes)")
        if self.top_k < 0:
            msgspec.structs.force_setattr(self, "top_k", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_p < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """The same parameters with max_tokens resolved against the context (the decoder's Engine.prepare)."""
        assert max_tokens >= 1, "max_tokens is resolved to at least one token"
        return msgspec.structs.replace(self, max_tokens=max_tokens)
