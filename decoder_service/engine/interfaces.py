"""The engine's side of its boundary with the service shell: what the shell passes in (settings, metrics hooks, a
compiled grammar, a hand-off sink) as protocols the shell's objects satisfy, and the error that is a request's own."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from decoder_service.engine.spec.config import SpecConfig


class EngineSettings(Protocol):
    """The flags the engine runs by (decoder_service/config.py DecoderConfig has them all)."""

    @property
    def max_model_len(self) -> int: ...  # 0: the model's max_position_embeddings
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def seqs_per_request(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def prefix_cache_bytes(self) -> int: ...
    @property
    def gpu_memory_utilization(self) -> float: ...
    @property
    def kv_cache_memory(self) -> int: ...
    @property
    def num_batched_tokens(self) -> int: ...
    @property
    def max_prefill_tokens(self) -> int: ...
    @property
    def enforce_eager(self) -> bool: ...
    @property
    def cpu_exact_linear(self) -> bool: ...
    @property
    def cpu_sdpa_attention(self) -> bool: ...
    @property
    def engine_stall_timeout(self) -> float: ...
    @property
    def speculative_config(self) -> SpecConfig | None: ...


class Observer(Protocol):
    def observe(self, amount: float, /) -> None: ...


class Tally(Protocol):
    def inc(self, amount: float = 1, /) -> None: ...


class SequenceMetrics(Protocol):
    """What a sequence reports as it streams and finishes (decoder_service/metrics.py DecoderMetrics)."""

    @property
    def ttft(self) -> Observer: ...
    @property
    def itl(self) -> Observer: ...
    @property
    def e2e(self) -> Observer: ...
    @property
    def generated_tokens(self) -> Tally: ...
    @property
    def prompt_tokens(self) -> Tally: ...

    def request_finished(self, arrival: float, admitted: float, first: float, last: float) -> None: ...


class GuideMatcher(Protocol):
    """One choice's grammar state: the tokens it refuses next (the sampler's Guide), and whether it has ended."""

    def refused(self, vocab: int, device: torch.device) -> torch.Tensor: ...  # (vocab,) bool: refused tokens

    def accept(self, token: int) -> None: ...

    @property
    def terminated(self) -> bool: ...


class CompiledGrammar(Protocol):
    """A request's compiled grammar (decoder_service/grammar.py CompiledGuide): a matcher for each choice."""

    def matcher(self) -> GuideMatcher: ...


class RequestFault(ValueError):
    """A failure that is the request's own (a token its grammar refuses): its 400 naming `param`, not a server
    fault."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
