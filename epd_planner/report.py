"""A Decision as the plain text `epd-planner --once` and `--replay` print: the SLOs, then per role current ->
desired, utilisation, queueing, headroom and why."""
from __future__ import annotations

from epd_planner.model import Decision, RolePlan, Targets


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g} s"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def header(d: Decision, targets: Targets) -> str:
    rate = "-" if d.request_rate is None else f"{d.request_rate:.3g}"
    return (f"window {d.window:.3g} s: {rate} requests/s; TTFT p90 {_seconds(d.ttft_p90)} (SLO {targets.ttft_slo:g} s), "
            f"ITL p90 {_seconds(d.itl_p90)} (SLO {targets.itl_slo:g} s); target utilisation "
            f"{d.target_utilization:.0%}")


def role_lines(p: RolePlan, recommended: int | None = None) -> list[str]:
    after = "" if recommended is None or recommended == p.desired else f" (recommended now: {recommended})"
    lines = [f"{p.role:<8} {p.current} -> {p.desired}{after}   utilisation {_share(p.utilization)}   "
             f"queue wait {_seconds(p.queue_wait)}"]
    if p.readable and p.current:
        lines.append(f"  headroom: {p.headroom}")
    lines.append(f"  why: {p.reason}")
    return lines


def render(d: Decision, targets: Targets, recommended: dict[str, int] | None = None) -> str:
    """The whole report, one line per fact."""
    lines = [header(d, targets)]
    for role, plan in d.plans.items():
        lines += role_lines(plan, None if recommended is None else recommended.get(role))
    lines += [f"note: {n}" for n in d.notes]
    return "\n".join(lines)
