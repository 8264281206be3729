"""The decoder's fair-share policy: who takes the next free row, how many rows a job may hold, who is preempted.

Pure decisions over the scheduler's state (decoder_service/engine/scheduler.py admits, preempts and resumes).

A client is a request's cache_salt ("" is one client). Each admission takes, among the preempted sequences and
the waiting jobs, one of the client holding the fewest rows now (preempted sequences before new jobs of the same
client, then by arrival: `next_pick`); a client with no prompt still prefilling may start one even when other
clients' prompts fill this step's prefill budget. A job holds at most `share` rows at once (--max-seqs-per-request;
a prefill worker's hand-off job, which holds its rows for one token, takes its n rows together: `share_of`), and a
job at its share never holds back the jobs queued behind it. A request that does not fit the pool may preempt only
decoding sequences of clients holding at least two rows more than its own (`room_victims`: rows even out between
clients, never a thrash between equals); growth preempts a decoding sequence of the client holding the most blocks,
the one of them holding the most (the newest of equals: `preempt_choice`). Each step's prefill budget is split
between the prompts prefilling (`split_prefill_budget`, for the model runner): parts of at least an eighth of it
(whole blocks), short rests first. So a new short request of another client is never queued behind every earlier long one.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decoder_service.engine.sequence import Job, Sequence
    from decoder_service.engine.step_inputs import Row

def share_of(job: Job, share: int) -> int:
    """Rows the job may hold at once: a prefill worker's hand-off job all n (it holds them for one token)."""
    return job.params.n if job.work.handoff_key is not None else share


def choices_left(job: Job) -> int:
    """Choices of the job not admitted yet (a continued job's: those that continue here)."""
    if job.work.resume is None:
        return job.params.n - job.next_choice
    return sum(c.first_token is not None for c in job.work.resume.handoff.choices[job.next_choice:])


def next_pick(running: Mapping[int, Sequence], rows: Mapping[Hashable, Row],
              preempted: Iterable[tuple[int, Sequence]], waiting: Iterable[Job], held: Mapping[Job, list[int]],
              share: int, within_budget: bool) -> tuple[int, Sequence] | Job | None:
    """The next preempted sequence or waiting job to take a row: of the client holding the fewest rows now
    (preempted before new, then by arrival). Jobs at their share (`held`: a job's running slot keys) wait for their
    own rows, not holding back others; a client whose prompt is still prefilling starts another only
    `within_budget` (this step's prefill budget is not spent yet)."""
    clients: Counter[str] = Counter()
    prefilling: set[str] = set()
    for k, seq in running.items():
        clients[seq.job.work.client] += 1
        if (row := rows.get(k)) is not None and not row.prefilled:
            prefilling.add(seq.job.work.client)
    best: tuple[tuple[int, int, float], tuple[int, Sequence] | Job] | None = None
    for key, seq in preempted:
        client = seq.job.work.client
        rank = (clients[client], 0, seq.job.arrival)
        if (within_budget or client not in prefilling) and (best is None or rank < best[0]):
            best = (rank, (key, seq))
    for job in waiting:
        client = job.work.client
        rank = (clients[client], 1, job.arrival)
        if (job.errored or not choices_left(job) or len(held.get(job, ())) >= share_of(job, share)
                or not (within_budget or client not in prefilling)):
            continue
        if best is None or rank < best[0]:
            best = (rank, job)
    return best[1] if best is not None else None


def preempt_choice(running: Mapping[int, Sequence], rows: Mapping[Hashable, Row], among: Iterable[int]) -> int:
    """Which of `among` (decoding slot keys) to preempt: one of the client holding the most blocks, the one of them
    holding the most, the newest of equals."""
    held: Counter[str] = Counter()
    for k, seq in running.items():
        if k in rows:
            held[seq.job.work.client] += len(rows[k].blocks)
    return max(among, key=lambda k: (held[running[k].job.work.client], len(rows[k].blocks), k))


def room_victims(running: Mapping[int, Sequence], client: str, is_decoding: Callable[[int], bool]) -> list[int]:
    """The decoding sequences a request of `client` that does not fit the pool may preempt: those of a client
    holding at least two rows more than `client` does (so clients' rows even out; never a sequence of its own
    client or of one as light)."""
    clients = Counter(seq.job.work.client for seq in running.values())
    return [k for k, seq in running.items() if clients[seq.job.work.client] >= clients[client] + 2 and is_decoding(k)]


PREFILL_PARTS = 8  # a step's prefill budget is shared by at most this many prompts at once (a part's floor)


def split_prefill_budget(limits: Mapping[Hashable, int], budget: int, floor: int) -> dict[Hashable, int]:
    """Positions each prompt still prefilling takes this step, from `limits` (what each may take, in admission order):
    an equal part of the budget each, at least `floor` (a block) and a `PREFILL_PARTS`-th of the budget in whole
    blocks, so a burst of prompts prefills a few at a time in large chunks, as vLLM's first come, first served does,
    rather than each a sliver a step. Prompts whose rest fits in a part go first, so a short prompt admitted beside
    long ones completes in the steps its own length needs; the others in admission order; then what some cannot use
    to the others."""
    if budget <= 0 or not limits:
        return {}
    part = -(-(budget // PREFILL_PARTS) // floor) * floor  # whole blocks, so prompts end their chunks together
    share = max(floor, part, -(-budget // len(limits)))
    order = [k for k, n in limits.items() if n <= share] + [k for k, n in limits.items() if n > share]
    grant: dict[Hashable, int] = {}
    for key in order:
        grant[key] = min(limits[key], share, budget)
        budget -= grant[key]
    for key in order:
        more = min(limits[key] - grant[key], budget)
        grant[key] += more
        budget -= more
    return {key: grant[key] for key in limits}
