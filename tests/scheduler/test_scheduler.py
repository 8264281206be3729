"""Scheduler: skip what any cache holds (encoder or decoder side), split the rest by load."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from connector import ECConsumer, ECProducer, EncoderOutput
from scheduler.cache_index import FleetCacheIndex
from scheduler.scheduler import EncoderSlot, MMItem, Scheduler


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


def output(h: str) -> EncoderOutput:
    return EncoderOutput(mm_hash=h, embeds=torch.ones(4, 8))


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
        assert [i.mm_hash for i in out.scheduled_encoder_inputs[0]] == ["new"]
    finally:
        if isinstance(view, ECConsumer):
            view.close()


def test_scheduler_skips_what_the_event_index_says_an_encoder_holds(producer: ECProducer) -> None:
    consumer = ECConsumer(cache_bytes=0)
    index = FleetCacheIndex(consumer)
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
        consumer.close()


def test_images_of_one_request_are_split_across_encoders() -> None:
    out = create_scheduler(set(), set()).schedule(items("a", "b", "c", "d"))
    assert {i: len(v) for i, v in out.scheduled_encoder_inputs.items()} == {0: 2, 1: 2}
    assert set(out.sources.values()) == {"tcp://e0", "tcp://e1"}


def test_least_loaded_encoder_gets_the_next_item() -> None:
    sched = create_scheduler(set(), set())
    sched.schedule(items("a", "b", "c"))  # e0: 2, e1: 1 outstanding
    assert list(sched.schedule(items("d")).scheduled_encoder_inputs) == [1]
    sched.update_from_output(0, 2)
    assert list(sched.schedule(items("e")).scheduled_encoder_inputs) == [0]


def test_repeated_image_in_one_request_is_scheduled_once() -> None:
    out = create_scheduler(set()).schedule(items("a", "a", "b", "a"))
    assert [i.mm_hash for i in out.scheduled_encoder_inputs[0]] == ["a", "b"]


def test_item_cached_on_second_encoder_points_at_it() -> None:
    out = create_scheduler(set(), {"x"}).schedule(items("x"))
    assert out.skipped == ["x"] and out.sources == {"x": "tcp://e1"} and out.num_scheduled == 0


def test_recovery_schedule_re_encodes_even_cached_items() -> None:
    out = create_scheduler({"x"}).schedule(items("x"), skip_cached=False)
    assert out.skipped == [] and out.num_scheduled == 1
