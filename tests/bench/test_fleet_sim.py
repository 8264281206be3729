"""The fleet simulator on a small fleet: the real placement near an all-knowing one, the proxy's index within its
capacity whatever the catalogue, about 1/n of the held items moved when one of n encoders leaves, and the planner
over a day keeping the model's SLOs on fewer worker-hours than a fleet fixed for the peak."""
from __future__ import annotations

from connector.control.hint_index import MIN_PER_PRODUCER
from epd_bench.fleet_day import DayModel, day
from epd_bench.fleet_sim import Workload, decoder_moves, loaded, simulate
from epd_planner.model import Bounds, Targets


def test_placement_hits_nearly_as_often_as_an_all_knowing_one_with_a_bounded_index() -> None:
    w = Workload(catalogue=5000, requests=6000)
    real = simulate(w, num_encoders=40, num_proxies=4, cache_items=100, index_capacity=1024)
    oracle = simulate(w, num_encoders=40, num_proxies=1, cache_items=100, index_capacity=10 ** 9)
    assert 0.2 < oracle["hit_rate"] < 0.95  # a catalogue larger than the fleet's cache: some hits, some misses
    assert oracle["hit_rate"] - real["hit_rate"] < 0.03
    # the index keeps at most MIN_PER_PRODUCER (64) a producer when the capacity's share is smaller: 40 x 64
    assert real["index_entries"] <= 40 * MIN_PER_PRODUCER < real["held"]  # the fleet holds more than that
    assert 0 < real["moved"]["leave"] < 2 / 40 and 0 < real["moved"]["join"] < 2 / 40


def test_the_index_stays_within_its_capacity_however_many_images() -> None:
    sizes = [simulate(Workload(catalogue=c, requests=3000), 20, 2, 200, 2048)["index_entries"] for c in (500, 50_000)]
    assert sizes[0] < 2048 and sizes[1] <= 2048  # a small catalogue all held; a large one: the newest 2048


def test_load_is_spread_when_every_image_is_new() -> None:
    run = loaded(num_encoders=30, num_proxies=1, requests=6000, utilization=0.9)
    assert run["work_imbalance"] < 1.5 and run["work_per_encoder"] > 100


def test_one_decoder_leaving_moves_only_its_conversations() -> None:
    assert 0 < decoder_moves(20, conversations=4000) < 2 / 20


def test_the_planner_keeps_the_slos_on_fewer_worker_hours_and_within_its_bounds() -> None:
    model = DayModel(encoders=100, decoders=10, peak_rps=1750)
    bounds = Bounds(min_encoders=5, max_encoders=200, min_decoders=2, max_decoders=20)
    fixed, planned = (day(model, p, Targets(), bounds) for p in (False, True))
    starved = day(model, False, Targets(), bounds, share=0.6)
    assert fixed["slo_broken_windows"] == planned["slo_broken_windows"] == 0 < starved["slo_broken_windows"]
    assert planned["encoder_hours"] < 0.8 * fixed["encoder_hours"]
    assert planned["decoder_hours"] < 0.8 * fixed["decoder_hours"]
    assert planned["encoders_min_max"][0] >= 5 and planned["decoders_min_max"][0] >= 2
