"""The plan on real recorded traces (tests/data/planner/*.jsonl, recorded with `epd-planner --record` against the demo
stack: 1 encoder, 1 decoder, 2 CPU cores; README "Sizing the fleet"), against answers worked out by hand here from
the trace's raw numbers, not from the planner's output."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from epd_planner.model import Bounds, Targets, decide
from epd_planner.planner import PlannerConfig, replay
from epd_planner.sample import Sample, Scrape, read_trace

DATA = Path(__file__).resolve().parents[1] / "data" / "planner"


def trace(name: str) -> list[Sample]:
    return read_trace((DATA / f"{name}.jsonl").read_text())


def worker(sample: Sample, role: str) -> Scrape:
    (found,) = sample.of(role)
    return found


def test_traces_are_small_real_recordings() -> None:
    for name in ("image-burst", "light", "text-long"):
        samples = trace(name)
        assert 10 <= len(samples) <= 100 and (DATA / f"{name}.jsonl").stat().st_size < 200_000
        assert [s.replicas(r) for r in ("encoder", "prefill", "decoder") for s in samples[:1]] == [1, 0, 1]
        assert all(b.t > a.t for a, b in zip(samples, samples[1:], strict=False))
        assert all(s.error is None and all(w.error is None for w in s.workers) for s in samples)


def test_image_burst_peak_wants_two_encoders_and_two_decoders() -> None:
    a, b = trace("image-burst")[10:12]
    enc_a, enc_b = worker(a, "encoder"), worker(b, "encoder")
    # the raw numbers of this window
    assert (enc_a.values["epd_encoder_run_seconds_total"], enc_b.values["epd_encoder_run_seconds_total"]) == \
        (11.328628853007103, 14.191197498992551)
    assert (enc_a.t, enc_b.t) == (65025.42795431, 65028.480243816)
    # encoder busy = (14.1912 - 11.3286) / (65028.4802 - 65025.4280) = 2.8626 / 3.0523 = 0.9378
    busy = (14.191197498992551 - 11.328628853007103) / (65028.480243816 - 65025.42795431)
    assert busy == pytest.approx(0.9378, abs=1e-4)
    # ceil(0.9378 / 0.7) = ceil(1.34) = 2 encoders
    # TTFT bucket deltas: le 0.5: 252-241 = 11, le 1: 315-286 = 29, le 2.5: 367-313 = 54 (all); p90 rank 0.9 x 54 =
    # 48.6, in (1, 2.5]: 1 + 1.5 x (48.6 - 29) / (54 - 29) = 2.176 s > 2 s: broken.
    # mean TTFT = (165.6111 - 117.5999) / 54 = 0.8891 s; encoder queue wait = (299.8348 - 165.6616) / (2968 - 2536)
    # = 0.3106 s >= 0.25 x 0.8891 = 0.2223: the encoders are a cause too (1 + 1 = 2, the same 2)
    # decoder: waiting (8 + 6) / 2 = 7 of 32 slots = 0.219 (K/V 221 of 385683 blocks: ~0), ceil(0.219 / 0.7) = 1;
    # ITL deltas: le 0.1: 921-856 = 65, le 0.25: 1067-915 = 152, all 1093-929 = 164; rank 147.6:
    # 0.1 + 0.15 x (147.6 - 65) / (152 - 65) = 0.2424 s > 0.1 s: the decoders get one more, 2
    d = decide(a, b)
    assert d.ttft_p90 == pytest.approx(1 + 1.5 * (48.6 - 29) / 25)
    assert d.mean_ttft == pytest.approx((165.61111167193303 - 117.59989517591748) / 54)
    assert d.itl_p90 == pytest.approx(0.1 + 0.15 * (147.6 - 65) / 87)
    enc, dec = d.plans["encoder"], d.plans["decoder"]
    assert enc.utilization == pytest.approx(busy) and math.ceil(busy / 0.7) == 2
    assert enc.queue_wait == pytest.approx((299.83481873646815 - 165.661597521379) / 432)
    assert dec.utilization == pytest.approx(7 / 32)
    assert d.desired == {"encoder": 2, "prefill": 0, "decoder": 2}
    assert "encoders queue" in enc.reason and "ITL p90" in dec.reason
    # with an ITL target of 0.5 s the decoders' ITL is in target and 7/32 busy keeps 1; the encoders still need 2
    # on utilisation alone even with TTFT in a 5 s target
    relaxed = decide(a, b, Targets(ttft_slo=5.0, itl_slo=0.5))
    assert relaxed.desired == {"encoder": 2, "prefill": 0, "decoder": 1}
    assert "encoders queue" not in relaxed.plans["encoder"].reason


def test_text_long_burst_wants_a_second_decoder_for_its_admission_queue() -> None:
    a, b = trace("text-long")[7:9]
    dec_a, dec_b = worker(a, "decoder"), worker(b, "decoder")
    assert (dec_a.values["epd_decoder_waiting"], dec_b.values["epd_decoder_waiting"]) == (40.0, 40.0)
    assert dec_b.values["max_num_seqs"] == 32.0
    # decoder: (40 + 40) / 2 = 40 sequences held on 32 slots = 1.25 replicas' work; ceil(1.25 / 0.7) = ceil(1.79) = 2
    # TTFT deltas: le 1: 192-162 = 30, all: 256-210 = 46; rank 41.4: 1 + 1.5 x (41.4 - 30) / 16 = 2.069 s > 2 s
    # mean TTFT = (160.0115 - 125.7500) / 46 = 0.7448 s; the decoders' admission queue (no prefill workers: they
    # prefill) = (111.9807 - 77.7042) / (224 - 178) = 0.7451 s, all of it: a cause, 1 + 1 = 2 (the same 2)
    # encoder: no image in the window: 0 busy, but a stage in use keeps 1
    d = decide(a, b)
    assert d.ttft_p90 == pytest.approx(1 + 1.5 * 11.4 / 16)
    dec = d.plans["decoder"]
    assert dec.utilization == pytest.approx(1.25) and dec.busy == pytest.approx(1.25)
    assert dec.queue_wait == pytest.approx((111.98070282301342 - 77.70420347800973) / 46)
    assert d.desired == {"encoder": 1, "prefill": 0, "decoder": 2}
    assert "decoders queue" in dec.reason and d.plans["encoder"].utilization == 0
    # request rate: (264 - 218) requests / (65125.6400 - 65122.3460) s = 13.97 /s
    assert d.request_rate == pytest.approx(46 / (65125.639639987 - 65122.345971153))


def test_light_trace_never_asks_for_more_than_one_of_each() -> None:
    samples = trace("light")
    a, b = samples[4:6]
    # encoder busy = (0.0245968 - 0.0174453) / (64899.111112 - 64896.124264) = 0.0071515 / 2.98685 = 0.0024
    # ceil(0.0024 / 0.7) = 1; its items: (3 - 1) / 2.98685 = 0.670 /s, so the 70 % target is reached at
    # 0.670 x 0.7 / 0.0024 = 196 items/s
    d = decide(a, b)
    enc = d.plans["encoder"]
    busy = (0.024596843002655078 - 0.01744530699943425) / (64899.111112449 - 64896.124264236)
    assert enc.utilization == pytest.approx(busy)
    assert enc.rate_at_target == pytest.approx(2 / (64899.111112449 - 64896.124264236) * 0.7 / busy)
    # TTFT deltas: le 0.025: 2, all: 2; rank 1.8: 0.01 + 0.015 x 1.8 / 2 = 0.0235 s; decoder waiting 0, K/V 0
    assert d.ttft_p90 == pytest.approx(0.0235)
    assert d.desired == {"encoder": 1, "prefill": 0, "decoder": 1}
    # every window of the trace: nothing near 70 %, so 1, 0, 1 all along, and the hysteresis never moves
    steps = list(replay(samples, PlannerConfig()))
    assert len(steps) == len(samples) - 1
    assert all(s.decision.desired == s.recommended == {"encoder": 1, "prefill": 0, "decoder": 1} for s in steps)
    assert max(s.decision.plans["encoder"].utilization or 0 for s in steps) < 0.05


def test_the_bounds_hold_on_a_real_trace() -> None:
    a, b = trace("image-burst")[10:12]
    # the 2 encoders and 2 decoders of the peak window, under --max-encoders 1 and --min-decoders 3
    d = decide(a, b, bounds=Bounds(max_encoders=1, min_decoders=3, max_decoders=4))
    assert d.desired == {"encoder": 1, "prefill": 0, "decoder": 3}
    assert "held to --max-encoders 1" in d.plans["encoder"].reason
    assert "held to --min-decoders 3" in d.plans["decoder"].reason


def test_replaying_the_image_burst_scales_encoders_up_at_its_peak_and_holds_them() -> None:
    steps = list(replay(trace("image-burst"), PlannerConfig()))
    wanted = [s.decision.desired["encoder"] for s in steps]
    # windows 10 and 11 (0-based 9, 10) are the ones at 77 % and 94 % busy: ceil(0.77 / 0.7) = ceil(0.94 / 0.7) = 2
    assert wanted[9:11] == [2, 2] and max(wanted) == 2
    # the trace's fleet never changed (1 encoder): up at once (up_windows 1), and nothing ever goes below 1
    assert [s.recommended["encoder"] for s in steps] == wanted
