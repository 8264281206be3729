"""What the scheduler hands the runner for one step, and what the runner hands back (no import circle between them)."""
from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SchedulerOutput:
    decode: dict[Hashable, int]  # row key -> the token its sequence feeds back (every prefilled row)
    prefill_budget: int  # prompt tokens this step may prefill, chunk by chunk, in the same forward
    drafts: dict[Hashable, list[int]] = field(default_factory=dict)  # speculative: row key -> tokens proposed


class RowLogits(Mapping[Hashable, torch.Tensor]):
    """Row key -> its next-token logits, kept as the forward's (rows, vocab) matrices: a row's own tensor is made
    only when asked for, and `rows_of` hands the rows of one matrix back as that matrix (or one index_select), so a
    step's batched choice costs no per-row tensor (64 row views and a stack took 120 us; one argmax 33)."""

    def __init__(self) -> None:
        self._at: dict[Hashable, tuple[torch.Tensor, int | None]] = {}  # key -> (matrix, row) or (own tensor, None)

    def put_rows(self, keys: Sequence[Hashable], matrix: torch.Tensor) -> None:
        for i, key in enumerate(keys):
            self._at[key] = (matrix, i)

    def __setitem__(self, key: Hashable, logits: torch.Tensor) -> None:
        self._at[key] = (logits, None)

    def alias(self, key: Hashable, source: Hashable) -> None:
        """`key` starts from `source`'s logits (an n > 1 fork from its prompt's)."""
        self._at[key] = self._at[source]

    def __delitem__(self, key: Hashable) -> None:
        del self._at[key]

    def pop_own(self, key: Hashable) -> torch.Tensor:
        """A row's own tensor (a verification's (k + 1, vocab)), taken out."""
        t, i = self._at.pop(key)
        return t if i is None else t[i]

    def __getitem__(self, key: Hashable) -> torch.Tensor:
        t, i = self._at[key]
        return t if i is None else t[i]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def rows_of(self, keys: Sequence[Hashable]) -> torch.Tensor:
        """These rows' logits as one (len(keys), vocab) tensor: the matrix itself when they are all of its rows in
        order, one index_select when they share a matrix, else a stack."""
        places = [self._at[k] for k in keys]
        matrix = places[0][0] if places else None
        if matrix is not None and all(m is matrix and i is not None for m, i in places):
            index = [i for _, i in places]
            if index == list(range(matrix.shape[0])):
                return matrix
            return matrix.index_select(0, torch.tensor(index, device=matrix.device))
        return torch.stack([self[k] for k in keys])


@dataclass(frozen=True)
class RunnerOutput:
    logits: Mapping[Hashable, torch.Tensor]  # next-token logits of every row decoded, or whose prompt is now complete
    failed: dict[Hashable, tuple[str, Exception]]  # row key -> (stage, what broke it); its blocks kept
    resumed: set[Hashable] = field(default_factory=set)  # preempted rows whose K/V is whole again (no new token)
    # speculative: row key -> (logits (k + 1, vocab) after its fed token and each draft, the k drafts)
    verify: dict[Hashable, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)
