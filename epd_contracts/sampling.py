"""The sampling-parameters contract: the proxy builds it, the decoder receives it, the Sampler runs it.

Every value this model admits is one the engine can run (tests/contracts/test_sampling.py drives the real
Sampler with the extremes); everything else is refused here, at the edge, with the parameter named.
Torch-free: the proxy imports it.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

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

Seed = Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, le=MAX_TOP_K)]  # 0 and -1 (vLLM's spelling) both mean off
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]


class SamplingParams(BaseModel):
    """How one sequence chooses its tokens and when it stops."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_tokens: MaxTokens | None = None  # None: up to the context (the decoder resolves it)
    temperature: Temperature = 1.0  # below GREEDY_BELOW: greedy
    top_p: TopP = 1.0  # below GREEDY_BELOW: greedy
    top_k: TopK = 0  # 0: off
    seed: Seed | None = None
    stop: Annotated[tuple[StopString, ...], Field(max_length=MAX_STOP_STRINGS)] = ()
    ignore_eos: bool = False
    frequency_penalty: Penalty = 0.0  # OpenAI: minus this times how often a token was already generated
    presence_penalty: Penalty = 0.0  # OpenAI: minus this once a token has been generated at all

    @field_validator("top_k")
    @classmethod
    def _off_is_zero(cls, v: int) -> int:
        return max(v, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_p < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """The same parameters with max_tokens resolved against the context (the decoder's Engine.prepare)."""
        assert max_tokens >= 1, "max_tokens is resolved to at least one token"
        return self.model_copy(update={"max_tokens": max_tokens})
