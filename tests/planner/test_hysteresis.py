"""The hysteresis: up at once, down only after `down_windows` windows and with room to spare, one replica at a time,
within the bounds, and no flapping on a load that swings."""
from __future__ import annotations

import math

from epd_planner.hysteresis import Hysteresis
from epd_planner.model import Bounds, Decision, RolePlan, Targets, decide
from epd_planner.sample import Sample
from epd_planner.signals import collect
from tests.planner.fakes import FakeFleet


def window(current: int, desired: int, utilization: float | None = None, readable: bool = True,
           role: str = "encoder") -> Decision:
    """A decision on one role (`utilization`: what load implies when not given: desired x 0.7 / current)."""
    util = utilization if utilization is not None else (desired * 0.7 / current if current else 0.0)
    plan = RolePlan(role, current, desired, readable, "test", utilization=util)
    return Decision(30.0, 0.7, {role: plan})


def test_scale_up_is_at_once_by_default_and_after_up_windows_when_asked() -> None:
    assert Hysteresis().update(window(1, 3)) == {"encoder": 3}
    h = Hysteresis(up_windows=2)
    assert [h.update(window(1, 3))["encoder"] for _ in range(2)] == [1, 3]


def test_scale_down_only_after_down_windows_in_a_row_and_one_step_at_a_time() -> None:
    h = Hysteresis(down_windows=3)
    # 5 encoders 10 % busy: one fewer would run at 0.1 x 5 / 4 = 12.5 %, under 70 % - 10 %
    got = [h.update(window(5, 1, utilization=0.1))["encoder"] for _ in range(3)]
    assert got == [5, 5, 4]  # the third window: one down, not to 1
    # the count starts again: the next step down waits three more windows
    assert [h.update(window(4, 1, utilization=0.1))["encoder"] for _ in range(3)] == [4, 4, 3]


def test_a_window_that_is_not_below_breaks_the_run_down() -> None:
    h = Hysteresis(down_windows=3)
    seq = [window(3, 1, 0.1), window(3, 1, 0.1), window(3, 3, 0.7), window(3, 1, 0.1), window(3, 1, 0.1)]
    assert [h.update(d)["encoder"] for d in seq] == [3, 3, 3, 3, 3]


def test_no_scale_down_without_room_under_the_target_minus_the_margin() -> None:
    # 2 encoders at 32 %: the model wants ceil(0.64 / 0.7) = 1, but one would run at 0.32 x 2 / 1 = 64 %,
    # not under 70 % - 10 % = 60 %: held at 2 however long it lasts
    h = Hysteresis(down_windows=1, margin=0.1)
    assert {h.update(window(2, 1, utilization=0.32))["encoder"] for _ in range(10)} == {2}
    assert "64%" in h.why["encoder"]
    # at 29 %: 58 % after, under 60 %: one down
    assert Hysteresis(down_windows=1).update(window(2, 1, utilization=0.29)) == {"encoder": 1}


def test_no_flapping_on_a_load_that_swings_every_window() -> None:
    """A closed loop: the fleet takes each recommendation; the load swings between 1.0 and 0.3 replicas' work."""
    h, n, counts = Hysteresis(), 1, []
    for i in range(30):
        busy = 1.0 if i % 2 == 0 else 0.3
        desired = max(1, math.ceil(busy / 0.7))
        n = h.update(window(n, desired, utilization=busy / n))["encoder"]
        counts.append(n)
    # up to 2 at the first peak, and never down again: a low window never lasts three in a row
    assert counts == [2] * 30


def test_an_unreadable_window_keeps_the_count_and_breaks_both_runs() -> None:
    h = Hysteresis(up_windows=2, down_windows=2)
    assert h.update(window(3, 5))["encoder"] == 3
    assert h.update(window(3, 3, readable=False))["encoder"] == 3
    assert h.update(window(3, 5))["encoder"] == 3  # the run up started again
    assert h.update(window(3, 5))["encoder"] == 5


def test_an_unreadable_window_is_not_moved_into_the_bounds() -> None:
    """Garbage never scales: a kept count stays as it is, even outside the bounds."""
    h = Hysteresis(Bounds(min_encoders=2))
    assert h.update(window(1, 1, readable=False)) == {"encoder": 1}
    assert h.update(window(1, 1)) == {"encoder": 2}  # a readable window: raised to the minimum


def test_never_above_max_never_below_min() -> None:
    bounds = Bounds(min_encoders=2, max_encoders=4)
    assert Hysteresis(bounds).update(window(3, 20)) == {"encoder": 4}
    h = Hysteresis(bounds, down_windows=1)
    assert {h.update(window(2, 0, utilization=0.0))["encoder"] for _ in range(5)} == {2}


def test_zero_load_plans_the_minimum_never_below() -> None:
    """Two reads of an idle fleet: the model's count is the minimum, and the hysteresis walks down to it and stops."""
    fleet = FakeFleet()
    with fleet.client() as client:
        a, b = collect(fleet.base, client=client), collect(fleet.base, client=client)
    assert isinstance(a, Sample) and b.t > a.t
    bounds = Bounds(min_encoders=2, min_decoders=3)
    d = decide(a, b, Targets(), bounds)
    assert d.desired == {"encoder": 2, "prefill": 0, "decoder": 3}
    h = Hysteresis(Bounds(min_encoders=1), down_windows=1)
    n = 4
    for _ in range(6):
        n = h.update(window(n, 1, utilization=0.0))["encoder"]
    assert n == 1


def test_a_large_fleet_steps_down_a_tenth_at_a_time_never_past_the_desired_count_or_the_target() -> None:
    h = Hysteresis(Bounds(max_encoders=2000), down_windows=1)
    # 1000 encoders at 20 %: the model wants 286; 10 % fewer (900) run at 0.2 x 1000 / 900 = 22 %, under 60 %
    assert h.update(window(1000, 286, utilization=0.2)) == {"encoder": 900}
    assert h.update(window(300, 286, utilization=0.66)) == {"encoder": 300}  # 0.66 x 300 / 299 is over 60 %
    # 100 encoders at 55 %: 10 fewer would run at 61 %: it takes the most that stays under 60 % (8: 59.8 %)
    assert h.update(window(100, 80, utilization=0.55)) == {"encoder": 92}
    assert h.update(window(20, 19, utilization=0.1)) == {"encoder": 19}  # never below what the model wants
