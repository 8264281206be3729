"""So the plan does not flap: what `model.decide` wants becomes the recommended count only once it has wanted it
long enough (`Hysteresis.update`).

- Up: as soon as the desired count has been above the current one for `up_windows` windows in a row (default 1:
  at once), the whole way to the desired count.
- Down: only after `down_windows` windows in a row below the current count (default 3), and only if the
  utilisation left after removing them (utilisation x n / (n - k)) stays under the target minus `margin`; then k
  replicas, at most `down_step` of the count (default 10 %) but always one, and never below the desired count;
  the count of windows starts again (each further step waits as long). So a small fleet steps down one at a time,
  and a thousand encoders do not take days to follow a quiet night.
- A window that could not be read (`RolePlan.readable` False) recommends the current count as it is (not even
  moved into the bounds: nothing is scaled on garbage) and breaks both runs.
- Otherwise always within the bounds (they win over the one-step rule when the current count is outside them).
"""
from __future__ import annotations

from dataclasses import dataclass

from epd_planner.model import Bounds, Decision, RolePlan


@dataclass
class _Runs:
    up: int = 0  # windows in a row whose desired count was above the current one
    down: int = 0  # ... below it


class Hysteresis:
    def __init__(self, bounds: Bounds | None = None, up_windows: int = 1, down_windows: int = 3,
                 margin: float = 0.1, down_step: float = 0.1) -> None:
        assert up_windows >= 1 and down_windows >= 1, "up_windows and down_windows must be >= 1"
        assert 0 <= margin < 1, "margin must be in [0, 1)"
        assert 0 <= down_step < 1, "down_step must be in [0, 1)"
        self.bounds = bounds or Bounds()
        self.up_windows, self.down_windows, self.margin, self.down_step = up_windows, down_windows, margin, down_step
        self.runs: dict[str, _Runs] = {}
        self.why: dict[str, str] = {}  # role -> why the last update recommended what it did

    def update(self, decision: Decision) -> dict[str, int]:
        """The recommended count per role after this window."""
        return {role: self._role(plan, decision.target_utilization) for role, plan in decision.plans.items()}

    def _role(self, plan: RolePlan, target: float) -> int:
        runs = self.runs.setdefault(plan.role, _Runs())
        n = plan.current
        if not plan.readable:
            runs.up = runs.down = 0
            self.why[plan.role] = "unreadable window: the current count, as it is"
            return n
        if plan.desired > n:
            runs.up, runs.down = runs.up + 1, 0
            if runs.up >= self.up_windows:
                return self._held(plan.role, plan.desired, f"above for {runs.up} window(s): up")
            return self._held(plan.role, n, f"above for {runs.up} of {self.up_windows} window(s)")
        if plan.desired < n:
            runs.up, runs.down = 0, runs.down + 1
            if runs.down < self.down_windows:
                return self._held(plan.role, n, f"below for {runs.down} of {self.down_windows} window(s)")
            step = max(1, min(int(self.down_step * n), n - plan.desired))
            while step > 1 and _after(plan, n, step) >= target - self.margin:
                step -= 1
            after = _after(plan, n, step)
            if after >= target - self.margin:
                return self._held(plan.role, n, f"one fewer would run at {after:.0%}, not under "
                                                f"{target - self.margin:.0%}")
            runs.down = 0
            return self._held(plan.role, n - step, f"below for {self.down_windows} windows, {step} fewer at "
                                                   f"{after:.0%}: {step} down")
        runs.up = runs.down = 0
        return self._held(plan.role, n, "as desired")

    def _held(self, role: str, n: int, why: str) -> int:
        held = self.bounds.clamp(role, n)
        self.why[role] = why if held == n else f"{why}; held to {held} by the bounds"
        return held


def _after(plan: RolePlan, n: int, step: int) -> float:
    """The utilisation left on n - step replicas (1.0 when none would be left and there is work)."""
    if n - step <= 0:
        return 0.0 if not plan.utilization else 1.0
    return (plan.utilization or 0.0) * n / (n - step)
