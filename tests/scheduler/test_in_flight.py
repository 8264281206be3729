"""The scheduler owns the encodes in flight: one future per item, shared by every request for it, kept on failover."""
from __future__ import annotations

import pytest

from scheduler.scheduler import EncoderSlot, MMItem, NoEncoderAvailable, Scheduler


class FakeCache:
    def __init__(self, held: set[str] | None = None):
        self.held = held or set()

    def has_cache_item(self, mm_hash: str) -> bool:
        return mm_hash in self.held


def create_scheduler(num_encoders: int = 2) -> Scheduler:
    return Scheduler([EncoderSlot(f"e{i}", f"tcp://e{i}", FakeCache()) for i in range(num_encoders)])


def items(*hashes: str) -> list[MMItem]:
    return [MMItem(h, h.encode()) for h in hashes]


def test_a_joined_request_waits_on_the_future_of_the_encode_it_joined() -> None:
    sched = create_scheduler()
    first = sched.schedule(items("a"))
    second = sched.schedule(items("a"))
    assert second.joined == {"a": "e0"} and second.waits["a"] is first.waits["a"] and second.pending == {"a"}
    sched.update_from_output("e0", ["a"], "tcp://e0")
    assert first.waits["a"].result(timeout=0) == "tcp://e0" and sched.in_flight == {}


def test_an_error_reaches_every_request_waiting_for_the_item() -> None:
    sched = create_scheduler()
    waits = [sched.schedule(items("bad")).waits["bad"] for _ in range(2)]
    sched.update_from_output(sched.in_flight["bad"].encoder, ["bad"], ValueError("cannot identify image"))
    assert all(isinstance(w.exception(timeout=0), ValueError) for w in waits)
    assert sched.outstanding == {"e0": 0, "e1": 0}


def test_failover_moves_the_encode_to_another_encoder_with_the_same_future() -> None:
    sched = create_scheduler()
    first = sched.schedule(items("a", "b"))  # a -> e0, b -> e1: their rendezvous homes
    assert sched.take_back("e0", ["a"]) == ["a"] and sched.outstanding["e0"] == 0
    retry = sched.schedule(items("a"), exclude={"e0"})
    assert list(retry.scheduled_encoder_inputs) == ["e1"] and retry.waits["a"] is first.waits["a"]
    sched.update_from_output("e0", ["a"], "tcp://e0")  # the failed call's late answer settles nothing
    assert not first.waits["a"].done()
    sched.update_from_output("e1", ["a"], "tcp://e1")
    assert first.waits["a"].result(timeout=0) == "tcp://e1"


def test_a_new_request_takes_over_an_encode_whose_encoder_went_down() -> None:
    sched = create_scheduler()
    first = sched.schedule(items("a"))
    sched.set_healthy("e0", False)
    second = sched.schedule(items("a"))
    assert list(second.scheduled_encoder_inputs) == ["e1"] and second.waits["a"] is first.waits["a"]
    assert sched.take_back("e0", ["a"]) == []  # the down encoder's call has nothing left to retry


def test_a_failed_encode_now_cached_elsewhere_is_settled_from_the_cache() -> None:
    sched = Scheduler([EncoderSlot("e0", "tcp://e0", FakeCache()), EncoderSlot("e1", "tcp://e1", FakeCache({"a"}))])
    first = sched.schedule(items("a"), skip_cached=False)
    sched.take_back("e0", ["a"])
    retry = sched.schedule(items("a"), exclude={"e0"})
    assert retry.skipped == ["a"] and first.waits["a"].result(timeout=0) == "tcp://e1" and sched.in_flight == {}


def test_taken_back_items_with_nowhere_to_go_are_settled_with_the_error() -> None:
    sched = create_scheduler(1)
    wait = sched.schedule(items("a")).waits["a"]
    sched.take_back("e0", ["a"])
    with pytest.raises(NoEncoderAvailable):
        sched.schedule(items("a"), exclude={"e0"})
    sched.settle("e0", ["a"], RuntimeError("no encoder left"))
    assert isinstance(wait.exception(timeout=0), RuntimeError) and sched.in_flight == {}
