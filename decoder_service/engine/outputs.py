"""What the scheduler hands the runner for one step, and what the runner hands back (no import circle between them)."""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SchedulerOutput:
    decode: dict[Hashable, int]  # row key -> the token its sequence feeds back (every prefilled row)
    prefill_budget: int  # prompt tokens this step may prefill, chunk by chunk, in the same forward


@dataclass(frozen=True)
class RunnerOutput:
    logits: dict[Hashable, torch.Tensor]  # next-token logits of every row decoded, or whose prompt is now complete
    failed: dict[Hashable, tuple[str, Exception]]  # row key -> (stage, what broke it); its blocks kept
    resumed: set[Hashable] = field(default_factory=set)  # preempted rows whose K/V is whole again (no new token)
