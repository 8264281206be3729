"""The encode scheduler (encoder_service/encode_scheduler.py): items of concurrent calls batched within the item and
token budgets and by group, requests served in turn, calls past the pending bound refused, a failing item failing
alone, items of a caller that left never run. The runner here records batches; the thread is held on a gate while
the test queues, and every wait is for an event of the scheduler, never a fixed time."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
import torch
from PIL import Image

from encoder_service.encode_scheduler import BatchStats, Busy, EncodeScheduler
from epd_contracts.embeddings import ImageFeatures
from epd_models.encode import Encoded, ImageJob, Job
from epd_models.video_jobs import VideoJob
from tests.waiting import until  # the scheduler's state, polled under a hang guard

IMAGE = Image.new("RGB", (8, 8))


def job(name: str, detail: str = "auto") -> ImageJob:
    return ImageJob(name, IMAGE, detail)


def video(name: str) -> VideoJob:
    return VideoJob(name, clip=None)  # type: ignore[arg-type]  # the scheduler never looks at the frames


class Runner:
    """Records each batch's hashes; the first batch waits for `gate`; hashes in `bad` raise when run."""

    def __init__(self, bad: Sequence[str] = ()) -> None:
        self.batches: list[list[str]] = []
        self.started, self.gate, self.bad = threading.Event(), threading.Event(), set(bad)

    def __call__(self, jobs: Sequence[Job]) -> dict[str, Encoded]:
        self.batches.append([j.mm_hash for j in jobs])
        self.started.set()
        assert self.gate.wait(60), "the test never opened the gate"
        if self.bad & {j.mm_hash for j in jobs}:
            raise RuntimeError("vision failed")
        return {j.mm_hash: Encoded(ImageFeatures(embeds=torch.zeros(1, 4)), cached=False) for j in jobs}


def run_scenario(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(scenario())  # type: ignore[arg-type]


def held(runner: Runner, **kwargs: Any) -> tuple[EncodeScheduler, Callable[[str, list[tuple[Job, int]]], Any]]:
    """A scheduler whose thread is held by a first call ("hold") until the runner's gate opens."""
    sched = EncodeScheduler(runner, **kwargs)

    def submit(key: str, jobs: list[tuple[Job, int]]) -> Any:
        return asyncio.ensure_future(sched.submit(key, jobs))
    return sched, submit


def test_items_of_concurrent_calls_share_a_forward_within_the_item_and_token_budgets() -> None:
    runner = Runner()

    async def scenario() -> None:
        stats: list[BatchStats] = []
        sched, submit = held(runner, max_batch_items=3, max_batch_tokens=250, on_batch=stats.append)
        first = submit("hold", [(job("h"), 1)])
        await until(runner.started.is_set)
        calls = [submit(f"r{i}", [(job(f"i{i}"), 100)]) for i in range(5)]
        calls.append(submit("r5", [(job("big"), 1000)]))  # past the token budget: runs, alone
        await until(lambda: sched.num_waiting == 6)
        runner.gate.set()
        done = await asyncio.gather(first, *calls)
        assert all(len(d) == 1 for d in done)
        sched.shutdown()
        assert runner.batches == [["h"], ["i0", "i1"], ["i2", "i3"], ["i4"], ["big"]]
        assert [s.items for s in stats] == [1, 2, 2, 1, 1] and [s.tokens for s in stats] == [1, 200, 200, 100, 1000]
        assert all(w >= 0 for s in stats for w in s.waits)
    run_scenario(scenario)


@pytest.mark.parametrize(("exact", "expected"), [(True, [["h"], ["a1", "a2"], ["l1"], ["v1", "v2"]]),
                                                  (False, [["h"], ["a1"], ["l1"], ["v1"], ["v2"], ["a2"]])])
def test_only_items_of_one_group_share_a_forward_and_an_inexact_family_runs_each_alone(
        exact: bool, expected: list[list[str]]) -> None:
    """Images of one detail share a forward, video parts of any requests share one, never with images."""
    runner = Runner()

    async def scenario() -> None:
        sched, submit = held(runner, batches_exactly=exact)
        first = submit("hold", [(job("h"), 1)])
        await until(runner.started.is_set)
        calls = [submit("x", [(job("a1"), 1), (job("a2"), 1)]), submit("y", [(job("l1", "low"), 1)]),
                 submit("z", [(video("v1"), 1)]), submit("w", [(video("v2"), 1)])]
        await until(lambda: sched.num_waiting == 5)
        runner.gate.set()
        await asyncio.gather(first, *calls)
        sched.shutdown()
    run_scenario(scenario)
    assert runner.batches == expected


def test_requests_take_turns_and_the_items_of_a_caller_that_left_never_run() -> None:
    runner = Runner()

    async def scenario() -> None:
        sched, submit = held(runner, max_batch_items=1)
        first = submit("a", [(job("a0"), 1)])
        await until(runner.started.is_set)
        calls = {n: submit(n[0], [(job(n), 1)]) for n in ("a1", "a2", "b1", "c1", "b2")}
        await until(lambda: sched.num_waiting == 5)
        calls["b2"].cancel()
        await asyncio.wait([calls["b2"]])
        runner.gate.set()
        done = await asyncio.gather(first, *calls.values(), return_exceptions=True)
        assert isinstance(done[-1], asyncio.CancelledError)
        sched.shutdown()
    run_scenario(scenario)
    assert [b[0] for b in runner.batches] == ["a0", "a1", "b1", "c1", "a2"]


def test_calls_past_the_pending_bound_are_refused_and_nothing_of_them_queues() -> None:
    runner = Runner()

    async def scenario() -> None:
        sched, submit = held(runner, max_pending_tokens=300)
        first = submit("hold", [(job("h"), 5000)])  # nothing waits: admitted, however large
        await until(runner.started.is_set)
        ok = submit("r1", [(job("i1"), 200)])
        await until(lambda: sched.pending_tokens == 200)
        with pytest.raises(Busy) as refused:
            await sched.submit("r2", [(job("i2"), 50), (job("i3"), 60)])
        assert (refused.value.pending, refused.value.asked, refused.value.limit) == (200, 110, 300)
        assert sched.num_waiting == 1 and sched.pending_tokens == 200
        runner.gate.set()
        await asyncio.gather(first, ok)
        assert sched.pending_tokens == 0
        sched.shutdown()
    run_scenario(scenario)
    assert runner.batches == [["h"], ["i1"]]


def test_a_failing_item_fails_its_call_alone_and_the_store_hears_of_it_alone() -> None:
    runner = Runner(bad=["bad"])
    failed: list[str] = []

    async def scenario() -> list[Any]:
        sched, submit = held(runner, on_failed=failed.extend)
        first = submit("hold", [(job("h"), 1)])
        await until(runner.started.is_set)
        calls = [submit("x", [(job("good1"), 1)]), submit("y", [(job("bad"), 1)]), submit("z", [(job("good2"), 1)])]
        await until(lambda: sched.num_waiting == 3)
        runner.gate.set()
        out = await asyncio.gather(first, *calls, return_exceptions=True)
        sched.shutdown()
        return out

    out = run_scenario(scenario)
    assert isinstance(out[2], RuntimeError) and set(out[1]) == {"good1"} and set(out[3]) == {"good2"}
    assert failed == ["bad"]
    assert runner.batches[1] == ["good1", "bad", "good2"]  # the batch, then each alone
    assert runner.batches[2:] == [["good1"], ["bad"], ["good2"]]


def test_a_batchs_log_lines_carry_its_requests_ids() -> None:
    from epd_common.logs import request_id_var

    seen: list[str] = []

    def run(jobs: Sequence[Job]) -> dict[str, Encoded]:
        seen.append(request_id_var.get())
        return {j.mm_hash: Encoded(ImageFeatures(embeds=torch.zeros(1, 4)), cached=False) for j in jobs}

    async def scenario() -> None:
        sched = EncodeScheduler(run)
        await sched.submit("rid-1", [(job("a"), 1)])
        sched.shutdown()
    run_scenario(scenario)
    assert seen == ["rid-1"]


def test_each_call_hears_the_ids_and_sizes_of_the_forwards_its_items_ran_in() -> None:
    """Items batched together report one id (what a trace's `encode` span names); an item of a batch that failed
    reports the forward it then ran in alone."""
    runner = Runner(bad=["bad"])

    async def scenario() -> list[dict[int, int]]:
        sched = EncodeScheduler(runner)
        seen: list[dict[int, int]] = [{} for _ in range(5)]

        def submit(i: int, key: str, *jobs: Job) -> Any:
            return asyncio.ensure_future(sched.submit(key, [(j, 1) for j in jobs], seen[i]))
        first = submit(0, "hold", job("h"))
        await until(runner.started.is_set)
        calls = [submit(1, "x", job("a"), job("b")), submit(2, "y", job("c")), submit(3, "w", job("bad", "low")),
                 submit(4, "v", job("good", "low"))]
        await until(lambda: sched.num_waiting == 5)
        runner.gate.set()
        await asyncio.gather(first, *calls, return_exceptions=True)
        sched.shutdown()
        return seen

    hold, x, y, w, v = run_scenario(scenario)
    assert runner.batches == [["h"], ["a", "b", "c"], ["bad", "good"], ["bad"], ["good"]]
    assert hold == {1: 1} and x == y == {2: 3}
    assert v == {5: 1} and w == {}  # a call that failed hears nothing (its error is what it gets)
