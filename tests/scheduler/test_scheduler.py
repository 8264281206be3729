"""Scheduler routing rules: skip what any healthy cache holds, join what is being encoded, place the rest by rendezvous."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from connector.control.cache_index import FleetCacheIndex
from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from epd_contracts.embeddings import ImageFeatures
from scheduler.rendezvous import Ring, load_bound
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


def homed_on(ring: Ring, name: str, count: int, prefix: str = "img") -> list[str]:
    """`count` hashes whose rendezvous home in `ring` is `name`."""
    return [h for h in (f"{prefix}{i}" for i in range(10_000)) if ring.home(h) == name][:count]


def test_every_scheduler_places_an_item_on_its_rendezvous_home() -> None:
    # two proxies, each with its own scheduler, encoders listed in another order: the same item, the same encoder
    names = [f"e{i}" for i in range(5)]
    one = Scheduler([EncoderSlot(n, f"tcp://{n}", FakeCache()) for n in names])
    two = Scheduler([EncoderSlot(n, f"tcp://{n}", FakeCache()) for n in reversed(names)])
    ring = Ring(names)
    for i in range(40):  # one at a time: no encoder is busy, so each item goes home
        h = f"img{i}"
        (a,) = one.schedule(items(h)).scheduled_encoder_inputs
        (b,) = two.schedule(items(h)).scheduled_encoder_inputs
        one.update_from_output(a, [h], f"tcp://{a}")
        two.update_from_output(b, [h], f"tcp://{b}")
        assert a == b == ring.home(h)
    assert len({ring.home(f"img{i}") for i in range(40)}) == 5  # and homes are spread over every encoder


def test_a_home_at_the_load_bound_passes_items_to_the_next_in_their_ranking() -> None:
    sched = create_scheduler(set(), set(), set(), set())
    ring = Ring(list(sched.encoders))
    hashes = homed_on(ring, "e0", 8)  # eight items of one request, all homed on e0
    out = sched.schedule(items(*hashes))
    placed = {n: [i.mm_hash for i in v] for n, v in out.scheduled_encoder_inputs.items()}
    # the bound with m items already placed on 4 encoders is ceil(1.25 (m + 1) / 4): 1 for m = 0, 1, 2; 2 for
    # m = 3, 4, 5; 3 for m = 6, 7. e0 takes an item while under it: items 0, 3 and 6; each other one goes to the
    # next encoder in its own ranking that is under the bound
    assert placed["e0"] == [hashes[0], hashes[3], hashes[6]]
    assert sum(map(len, placed.values())) == 8 and max(sched.outstanding.values()) <= load_bound(7, 4) == 3
    for n, hs in placed.items():
        assert all(ring.ranking(h)[0] == "e0" and (n == "e0" or ring.ranking(h).index(n) >= 1) for h in hs)


def test_only_the_items_of_an_encoder_that_joins_or_leaves_move() -> None:
    names = [f"e{i}" for i in range(10)]
    hashes = [f"img{i}" for i in range(2000)]
    before = Ring(names)
    joined, left = Ring([*names, "e10"]), Ring(names[1:])
    moved_in = [h for h in hashes if before.home(h) != joined.home(h)]
    assert moved_in and all(joined.home(h) == "e10" for h in moved_in)  # only to the new encoder
    assert len(moved_in) < 2 * len(hashes) / 11  # about 1/11 of them
    moved_out = [h for h in hashes if before.home(h) != left.home(h)]
    assert {before.home(h) for h in moved_out} == {"e0"}  # only those the leaver held
    assert len(moved_out) == sum(before.home(h) == "e0" for h in hashes)


def test_a_crafted_key_cannot_pick_its_encoder_cheaply() -> None:
    # scores mix blake2b hashes: homes of similar keys are spread, not in runs
    ring = Ring([f"e{i}" for i in range(4)])
    homes = [ring.home(f"{'a' * 64}{i}") for i in range(400)]
    assert all(60 <= homes.count(n) <= 140 for n in ring.names)


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


class FakeIndex:
    def __init__(self, where: dict[str, list[str]]):
        self.where, self.asked = where, 0

    def holders(self, mm_hash: str) -> list[str]:
        self.asked += 1
        return self.where.get(mm_hash, [])


def test_with_a_fleet_index_rule_one_asks_it_once_per_item_not_every_encoder() -> None:
    slots = [EncoderSlot(f"e{i}", f"tcp://e{i}", FakeCache()) for i in range(50)]
    index = FakeIndex({"a": ["tcp://e7", "tcp://e3"], "down": ["tcp://e9"]})
    sched = Scheduler(slots, index=index)
    sched.set_healthy("e9", False)
    out = sched.schedule(items("a", "b", "down"), exclude={"e7"})
    assert out.skipped == ["a"] and out.sources["a"] == "tcp://e3"  # e7 excluded: the other holder
    assert {i.mm_hash for v in out.scheduled_encoder_inputs.values() for i in v} == {"b", "down"}  # e9 is down
    assert index.asked == 3


def test_numpy_and_plain_python_rank_alike() -> None:
    # the proxy image has no numpy: its rings compute the same scores in plain Python
    names = [f"http://10.0.0.{i}:8001" for i in range(37)]
    fast, plain = Ring(names), Ring(names, use_numpy=False)
    for key in (f"{i:064x}" for i in range(300)):
        assert fast.scores(key) == plain.scores(key) and fast.home(key) == plain.home(key)
    loads = [i % 4 for i in range(37)]
    assert [fast.pick(f"k{i}", loads, 2) for i in range(200)] == [plain.pick(f"k{i}", loads, 2) for i in range(200)]
    assert fast.ranking("x") == plain.ranking("x")
