"""A step's verifications (speculative decoding): each row's logits after its fed token and each draft become the
tokens it keeps.

Position i's logits choose the token after draft i (i = 0: after the fed token) exactly as a plain step would: the
same sampler, its penalties, grammar and logprobs advanced by each token kept. A greedy row keeps drafts while each
equals the argmax, then the argmax where one differs (or, all kept, the one after the last draft): token for token
plain greedy decoding's output. A sampled row keeps draft i with probability p(draft) and otherwise draws from p
without it (Sampler._verify), which leaves every token distributed as without speculation. A grammar that refuses a
draft gives it p = 0, so it is never kept.

Plain greedy rows take their argmaxes in one batched op and one transfer; the others choose position by position
(one host sync each). A stop, a length limit or a failure ends the row where it happens. Then the row's length is
rolled back to its fed token and the drafts it kept: the K/V of rejected positions is left where it is and written
over by the next step.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import torch

from decoder_service.engine.spec.stats import SpecStats

if TYPE_CHECKING:
    from decoder_service.engine.rows import RowTable
    from decoder_service.engine.scheduler import Scheduler

Accept = Callable[["Scheduler", int, int, "list[float] | None"], object]  # postprocess.accept


def verify_rows(verify: dict[Hashable, tuple[torch.Tensor, list[int]]], scheduler: Scheduler, rows: RowTable,
                stats: SpecStats | None, accept: Accept) -> None:
    running = scheduler.running
    keys = [k for k in verify if k in running]
    plain = [k for k in keys if running[k].sampler.batched]
    argmax: dict[Hashable, list[int]] = {}
    if plain:
        flat = torch.cat([verify[k][0] for k in plain]).argmax(dim=-1).tolist()
        at = 0
        for k in plain:
            n = verify[k][0].shape[0]
            argmax[k], at = flat[at: at + n], at + n
    for key in keys:
        assert isinstance(key, int), "engine keys are ints"
        logits, drafts = verify[key]
        row, job = rows.rows[key], running[key].job
        base = row.length - len(drafts) - 1  # the fed token's position
        kept = _keep(key, logits, drafts, argmax.get(key), scheduler, accept)
        if stats is not None:
            stats.note(len(drafts), kept)
        job.spec_draft_tokens += len(drafts)
        job.spec_accepted_tokens += kept
        if key in running and key in rows.rows:
            row.length = base + 1 + kept  # the fed token and the drafts kept; the last token chosen is pending


def _keep(key: int, logits: torch.Tensor, drafts: list[int], argmax: list[int] | None, scheduler: Scheduler,
          accept: Accept) -> int:
    """Accept the row's tokens position by position; returns how many drafts were kept."""
    seq = scheduler.running[key]
    job = seq.job
    for i in range(len(drafts) + 1):
        draft = drafts[i] if i < len(drafts) else None
        if argmax is not None:
            token: int | Exception = argmax[i]
        else:
            try:
                token = int(seq.sampler.choose(logits[i], draft))
            except Exception as exc:  # noqa: BLE001 - its own failure (accept fails the request)
                token = exc
        accept(scheduler, key, token, None)  # type: ignore[arg-type]
        if scheduler.running.get(key) is not seq:  # it finished or failed at this token
            return i + 1 if draft is not None and token == draft and not job.errored else i
        if token != draft:
            return i
    return len(drafts)
