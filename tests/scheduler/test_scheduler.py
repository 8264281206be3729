"""Scheduler routing rules: skip what any healthy cache holds, join what is being encoded, split the rest by load."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from connector.control.cache_index import FleetCacheIndex
from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from epd_contracts.embeddings import ImageFeatures
from scheduler.scheduler import EncoderSlot, MMItem, NoEncoderAvailable, Scheduler


class FakeCache:
    def __init__(self, held: set[str] | None = None):
        self.held = held or set()

    def has_cache_item(self, mm_hash: str) -> bool:
        return mm_hash in self.held


def create_scheduler(*held: set[str]) -> Scheduler:
    return Scheduler([EncoderSlot(f"e{i}", f"tcp://e{i}", FakeCache(h)) for i, h in enumerate(held)])


def items(*hashes: str) -> list[MMItem]:
    return [MMItem(h, h.encode()) for h in hashes]


@pytest.fixture
def producer() -> Iterator[ECProducer]:
    p = ECProducer().start()
    yield p
    p.close()


def output(h: str) -> ImageFeatures:
    return ImageFeatures(torch.ones(4, 8))


@pytest.mark.parametrize("role", ["ec_producer", "ec_consumer"])
def test_encoder_input_skipped_when_connector_already_has_the_item(role: str, producer: ECProducer) -> None:
    producer.save_caches("held", output("held"))
    if role == "ec_producer":
        view: object = producer
    else:
        view = ECConsumer()
        view.gather(["held"], {"held": producer.address}, timeout=5)  # now in the decoder's local cache
    try:
        sched = Scheduler([EncoderSlot("e0", producer.address, view)])  # type: ignore[arg-type]
        out = sched.schedule(items("held", "new"))
        assert sched.has_cache_item("held") and not sched.has_cache_item("new")
        assert out.skipped == ["held"]
        assert [i.mm_hash for i in out.scheduled_encoder_inputs["e0"]] == ["new"]
    finally:
        if isinstance(view, ECConsumer):
            view.close()


def test_scheduler_skips_what_the_event_index_says_an_encoder_holds(producer: ECProducer) -> None:
    index = FleetCacheIndex()
    try:
        producer.save_caches("a", output("a"))
        index.add(producer.address, producer.events_address)
        assert index.wait_for(lambda: index.has_cache_item("a"), 5.0)
        view = index.view(producer.address)
        assert view.has_cache_items(["a", "b"]) == [True, False]
        out = Scheduler([EncoderSlot("e0", producer.address, view)]).schedule(items("a", "b"))
        assert out.skipped == ["a"] and out.num_scheduled == 1
    finally:
        index.close()


def test_images_of_one_request_are_split_across_encoders() -> None:
    out = create_scheduler(set(), set()).schedule(items("a", "b", "c", "d"))
    assert {i: len(v) for i, v in out.scheduled_encoder_inputs.items()} == {"e0": 2, "e1": 2}
    assert set(out.sources.values()) == {"tcp://e0", "tcp://e1"}


def test_least_loaded_encoder_gets_the_next_item() -> None:
    sched = create_scheduler(set(), set())
    sched.schedule(items("a", "b", "c"))  # e0: 2, e1: 1 outstanding
    assert list(sched.schedule(items("d")).scheduled_encoder_inputs) == ["e1"]
    sched.update_from_output("e0", ["a", "c"], "tcp://e0")
    assert list(sched.schedule(items("e")).scheduled_encoder_inputs) == ["e0"]


def test_ties_take_turns_so_an_encoder_added_later_gets_one_at_a_time_traffic() -> None:
    sched = create_scheduler(set(), set())
    sched.add(EncoderSlot("back", "tcp://back", FakeCache()))  # e.g. back from a restart, added last
    chosen = []
    for i in range(2 * len(sched.encoders)):  # one request at a time: every encoder idle at each choice
        (name,) = sched.schedule(items(f"img{i}")).scheduled_encoder_inputs
        sched.update_from_output(name, [f"img{i}"], f"tcp://{name}")
        chosen.append(name)
    assert chosen == 2 * list(sched.encoders)  # round-robin: each in turn, twice


def test_repeated_image_in_one_request_is_scheduled_once() -> None:
    out = create_scheduler(set()).schedule(items("a", "a", "b", "a"))
    assert [i.mm_hash for i in out.scheduled_encoder_inputs["e0"]] == ["a", "b"]


def test_item_cached_on_second_encoder_points_at_it() -> None:
    out = create_scheduler(set(), {"x"}).schedule(items("x"))
    assert out.skipped == ["x"] and out.sources == {"x": "tcp://e1"} and out.num_scheduled == 0


def test_recovery_schedule_re_encodes_even_cached_items() -> None:
    out = create_scheduler({"x"}).schedule(items("x"), skip_cached=False)
    assert out.skipped == [] and out.num_scheduled == 1


def test_item_being_encoded_for_another_request_is_joined_not_encoded_again() -> None:
    sched = create_scheduler(set(), set())
    first = sched.schedule(items("a"))
    second = sched.schedule(items("a", "b"))
    owner = next(iter(first.scheduled_encoder_inputs))
    assert second.joined == {"a": owner} and second.sources["a"] == f"tcp://{owner}"
    assert [i.mm_hash for todo in second.scheduled_encoder_inputs.values() for i in todo] == ["b"]
    sched.update_from_output(owner, ["a"], f"tcp://{owner}")  # finished: a later request no longer joins it
    assert sched.schedule(items("a")).joined == {}


def test_unhealthy_encoder_gets_no_items_and_its_cache_does_not_count() -> None:
    sched = create_scheduler({"x"}, set())
    sched.set_healthy("e0", False)
    out = sched.schedule(items("x", "y", "z"))
    assert out.skipped == [] and list(out.scheduled_encoder_inputs) == ["e1"] and out.num_scheduled == 3
    sched.set_healthy("e0", True)
    assert sched.schedule(items("x")).skipped == ["x"]


def test_in_flight_items_of_a_failed_encoder_are_not_joined() -> None:
    sched = create_scheduler(set(), set())
    sched.schedule(items("a"))  # goes to e0
    sched.set_healthy("e0", False)
    out = sched.schedule(items("a"))
    assert out.joined == {} and list(out.scheduled_encoder_inputs) == ["e1"]


def test_excluded_encoders_are_skipped_and_no_encoder_left_raises() -> None:
    sched = create_scheduler(set(), set())
    assert list(sched.schedule(items("a"), exclude={"e0"}).scheduled_encoder_inputs) == ["e1"]
    with pytest.raises(NoEncoderAvailable):
        sched.schedule(items("b"), exclude={"e0", "e1"})


def test_added_and_removed_encoders_change_the_routing() -> None:
    sched = create_scheduler(set())
    sched.add(EncoderSlot("e9", "tcp://e9", FakeCache({"held"})))
    assert sched.schedule(items("held")).sources == {"held": "tcp://e9"}
    sched.remove("e9")
    assert sched.schedule(items("held")).sources == {"held": "tcp://e0"}
