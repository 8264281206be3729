"""Speculative decoding's counts, kept by the engine thread and read (plain ints) by /metrics: vLLM's
`spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos`."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    k: int  # num_speculative_tokens
    drafts: int = 0  # verifications run (one per row per step it proposed for)
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of them accepted
    per_position: list[int] = field(default_factory=list)  # accepted at draft position 0..k-1

    def __post_init__(self) -> None:
        self.per_position = [0] * self.k

    def note(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for i in range(accepted):
            self.per_position[i] += 1

    def summary(self) -> dict[str, object]:
        return {"k": self.k, "drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "accepted_per_position": list(self.per_position)}
