"""The plan for one window: per role, how busy it was, how long work queued, and how many replicas it should have
(`decide`). Pure: two samples in, a `Decision` out, every count with its reason.

A role's count is the one that keeps its utilisation under the target: ceil(busy ÷ target), busy being replicas'
worth of work (epd_planner/load.py). It is raised to one over the current count when an SLO is broken and that
role's own signal says it is the cause:
- TTFT p90 over --ttft-slo and encoders queue a large share (--queue-share) of the mean TTFT: encoders;
- the same with prefill workers queueing (arrival to admission): prefill workers;
- ITL p90 over --itl-slo, or K/V use at --kv-high or more, or (no prefill workers) TTFT broken with the decoders'
  admission queue a large share of it: decoders.
A role in use keeps at least one replica (the planner never removes a stage); all are held to their --min/--max.
A role any of whose healthy workers could not be read at either end of the window, or the whole fleet when the
proxy could not be, keeps its current count: the planner never scales on garbage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from epd_planner.load import Load, load_of
from epd_planner.sample import ROLES, BadValue, Sample
from epd_planner.window import Span, mean, merged, quantile, spans

FLAG = {"encoder": "encoders", "prefill": "prefills", "decoder": "decoders"}  # role -> its --min-X / --max-X


@dataclass(frozen=True)
class Targets:
    ttft_slo: float = 2.0  # seconds, p90 of the proxy's time to first token
    itl_slo: float = 0.1  # seconds, p90 of the proxy's inter-token latency
    utilization: float = 0.7  # busy share of a replica to stay under
    kv_high: float = 0.9  # K/V share in use at which the decoders are the bottleneck
    queue_share: float = 0.25  # a role's queueing, as a share of the mean TTFT, that makes it the bottleneck

    def __post_init__(self) -> None:
        assert self.ttft_slo > 0 and self.itl_slo > 0, "the SLOs must be > 0"
        assert 0 < self.utilization <= 1 and 0 < self.kv_high <= 1 and 0 < self.queue_share <= 1, \
            "utilization, kv_high and queue_share must be in (0, 1]"


@dataclass(frozen=True)
class Bounds:
    min_encoders: int = 1
    max_encoders: int = 16
    min_prefills: int = 0
    max_prefills: int = 16
    min_decoders: int = 1
    max_decoders: int = 16

    def __post_init__(self) -> None:
        for role in ROLES:
            assert 0 <= self.low(role) <= self.high(role), f"need 0 <= --min-{FLAG[role]} <= --max-{FLAG[role]}"

    def low(self, role: str) -> int:
        return int(getattr(self, f"min_{FLAG[role]}"))

    def high(self, role: str) -> int:
        return int(getattr(self, f"max_{FLAG[role]}"))

    def clamp(self, role: str, n: int) -> int:
        return min(max(n, self.low(role)), self.high(role))


@dataclass(frozen=True)
class RolePlan:
    role: str
    current: int  # workers /instances lists
    desired: int  # what this window says (before hysteresis)
    readable: bool  # False: kept at `current`, `reason` says what could not be read
    reason: str
    utilization: float | None = None  # mean busy share of a worker
    busy: float | None = None  # replicas' worth of work
    queue_wait: float | None = None  # mean seconds queued
    rate: float | None = None  # work per second in the window (`unit`)
    unit: str = ""
    rate_at_target: float | None = None  # the rate at which the current replicas reach the target utilisation
    rate_at_full: float | None = None  # ... and utilisation 1

    @property
    def headroom(self) -> str:
        if self.rate_at_target is None or self.rate_at_full is None:
            return "unknown (no load in the window)" if self.readable else "unknown"
        return (f"the target is reached at {self.rate_at_target:.3g} {self.unit} (now {self.rate or 0:.3g}), "
                f"saturation at {self.rate_at_full:.3g}")


@dataclass(frozen=True)
class Decision:
    window: float  # seconds between the two samples
    target_utilization: float
    plans: dict[str, RolePlan]
    ttft_p90: float | None = None
    itl_p90: float | None = None
    mean_ttft: float | None = None
    request_rate: float | None = None
    notes: list[str] = field(default_factory=list)  # what the window says beyond the plans

    @property
    def desired(self) -> dict[str, int]:
        return {role: p.desired for role, p in self.plans.items()}

    @property
    def current(self) -> dict[str, int]:
        return {role: p.current for role, p in self.plans.items()}

    @property
    def reasons(self) -> dict[str, str]:
        return {role: p.reason for role, p in self.plans.items()}


def decide(prev: Sample, cur: Sample, targets: Targets | None = None, bounds: Bounds | None = None) -> Decision:
    """The plan for the window from `prev` to `cur`."""
    targets, bounds = targets or Targets(), bounds or Bounds()
    window = cur.t - prev.t
    current = {role: (cur if cur.error is None else prev).replicas(role) for role in ROLES}
    fleet_problem = cur.error or prev.error or (None if window > 0 else "the samples are not in time order")
    proxies, problems = spans(prev.proxies, cur.proxies)
    if fleet_problem is None and (problems or not proxies):
        fleet_problem = "; ".join(problems) or "no proxy was read"
    if fleet_problem is None:
        try:
            return _decide(prev, cur, proxies, current, window, targets, bounds)
        except BadValue as exc:
            fleet_problem = str(exc)
    kept = {r: RolePlan(r, current[r], current[r], False, f"kept at {current[r]}: {fleet_problem}") for r in ROLES}
    return Decision(window, targets.utilization, kept, notes=[fleet_problem])


def _decide(prev: Sample, cur: Sample, proxies: list[Span], current: dict[str, int], window: float,
            targets: Targets, bounds: Bounds) -> Decision:
    ttft = merged([s.histogram("epd_proxy_time_to_first_token_seconds") for s in proxies])
    itl = merged([s.histogram("epd_proxy_inter_token_latency_seconds") for s in proxies])
    requests = sum(s.delta("epd_proxy_requests_total") for s in proxies) / window
    loads: dict[str, Load | str] = {}
    for role in ROLES:
        found, problems = spans(prev.of(role), cur.of(role))
        try:
            loads[role] = "; ".join(problems) if problems else load_of(role, found)
        except BadValue as exc:
            loads[role] = str(exc)
    ttft_p90, itl_p90, mean_ttft = quantile(ttft, 0.9), quantile(itl, 0.9), mean(ttft)
    decoders = loads["decoder"]
    if itl_p90 is None and isinstance(decoders, Load):
        itl_p90 = decoders.itl_p90  # no streamed chunks at the proxy: the decoders' own
    causes, notes = _causes(loads, current, ttft_p90, itl_p90, mean_ttft, targets)
    unhealthy = {role: sum(not w.healthy for w in cur.of(role)) for role in ROLES}
    plans = {role: _plan(role, current[role], unhealthy[role], loads[role], causes.get(role), targets, bounds)
             for role in ROLES}
    return Decision(window, targets.utilization, plans, ttft_p90, itl_p90, mean_ttft, requests, notes)


def _causes(loads: dict[str, Load | str], current: dict[str, int], ttft_p90: float | None, itl_p90: float | None,
            mean_ttft: float | None, t: Targets) -> tuple[dict[str, str], list[str]]:
    """role -> why it gets one more replica (an SLO broken by its own signal), and notes on what the SLOs say."""
    causes: dict[str, list[str]] = {}
    ttft_broken = ttft_p90 is not None and mean_ttft is not None and ttft_p90 > t.ttft_slo
    broken = f"TTFT p90 {ttft_p90 or 0:.3g} s over the {t.ttft_slo:g} s SLO"
    # the decoders prefill unless there are prefill workers: then their admission queue is a prefill queue
    for role in ("encoder", "prefill") if current["prefill"] else ("encoder", "decoder"):
        load = loads[role]
        wait = load.queue_wait if isinstance(load, Load) else None
        if ttft_broken and wait and mean_ttft and wait >= t.queue_share * mean_ttft:
            causes.setdefault(role, []).append(f"{broken}, {role}s queue {wait:.3g} s of its {mean_ttft:.3g} s mean")
    notes = []
    if ttft_broken and not causes:
        notes.append(f"{broken}, but no role queues {t.queue_share:.0%} of it: not scaling on TTFT")
    if ttft_p90 is None:
        notes.append("no first token in the window: TTFT not judged")
    decoders = loads["decoder"]
    if itl_p90 is not None and itl_p90 > t.itl_slo:
        causes.setdefault("decoder", []).append(f"ITL p90 {itl_p90:.3g} s over the {t.itl_slo:g} s SLO")
    if isinstance(decoders, Load) and decoders.kv_used is not None and decoders.kv_used >= t.kv_high:
        causes.setdefault("decoder", []).append(f"K/V {decoders.kv_used:.0%} in use (--kv-high {t.kv_high:.0%})")
    return {role: " and ".join(why) + ": one more" for role, why in causes.items()}, notes


def _plan(role: str, current: int, unhealthy: int, load: Load | str, cause: str | None, t: Targets,
          bounds: Bounds) -> RolePlan:
    if isinstance(load, str):
        return RolePlan(role, current, current, False, f"kept at {current}: {load}")
    if unhealthy and unhealthy == current:
        return RolePlan(role, current, current, False, f"kept at {current}: none of them is healthy")
    need = math.ceil(load.busy / t.utilization - 1e-9)
    if current > 0:
        need = max(need, 1)  # a stage in use is never planned away
    if current == 0:
        reasons = [f"no {role} workers in this fleet"]
    else:
        util = "no worker read" if load.utilization is None else f"utilisation {load.utilization:.0%} of {current}"
        reasons = [f"{util} ({load.busy:.2f} replicas' work): {need} keep it under {t.utilization:.0%}"]
    desired = need
    if cause is not None:
        desired = max(desired, current + 1)
        reasons.append(cause)
    if unhealthy and desired < current:
        desired = current  # which pod goes is not ours to pick: it could be a healthy one
        reasons.append(f"{unhealthy} unhealthy: not planning fewer")
    held = bounds.clamp(role, desired)
    if held != desired:
        which = "min" if held > desired else "max"
        reasons.append(f"held to --{which}-{FLAG[role]} {held}")
    at_target = at_full = None
    if load.utilization:
        at_full = load.rate / load.utilization
        at_target = at_full * t.utilization
    return RolePlan(role, current, held, True, "; ".join(reasons), load.utilization, load.busy, load.queue_wait,
                    load.rate, load.unit, at_target, at_full)
