"""The planner's targets, bounds and hysteresis as flags: epd-planner's (epd_planner/cli.py) and the launcher's
--autoscale (epd_launcher/autoscale_flags.py) take the same ones and build the same PlannerConfig."""
from __future__ import annotations

import argparse
from typing import Any

from epd_common.cli import fraction, non_negative, positive_seconds
from epd_planner.model import FLAG, Bounds, Targets
from epd_planner.planner import PlannerConfig


def add_target_flags(g: argparse._ActionsContainer) -> None:
    g.add_argument("--ttft-slo", type=positive_seconds, default=2.0, help="seconds: time to first token, p90")
    g.add_argument("--itl-slo", type=positive_seconds, default=0.1, help="seconds: inter-token latency, p90")
    g.add_argument("--target-utilization", type=fraction, default=0.7,
                   help="busy share of a replica to stay under: a role gets ceil(load / this) replicas")
    g.add_argument("--kv-high", type=fraction, default=0.9, help="K/V share in use at which decoders get one more")
    g.add_argument("--queue-share", type=fraction, default=0.25,
                   help="with TTFT over its SLO, the share of the mean TTFT a role's queueing must reach for that "
                        "role to get one more replica")


def add_bound_flags(g: argparse._ActionsContainer, defaults: dict[str, tuple[Any, Any]], note: str = "") -> None:
    """--min-X / --max-X per role; `defaults`: role -> (min, max) (None: resolved by the caller, `note` says how)."""
    for role, plural in FLAG.items():
        low, high = defaults[role]
        g.add_argument(f"--min-{plural}", type=non_negative, default=low, help=f"never fewer {role} replicas{note}")
        g.add_argument(f"--max-{plural}", type=non_negative, default=high, help=f"never more {role} replicas{note}")


def add_hysteresis_flags(g: argparse._ActionsContainer) -> None:
    g.add_argument("--up-windows", type=int, default=1, help="windows in a row wanting more before scaling up")
    g.add_argument("--down-windows", type=int, default=3,
                   help="windows in a row wanting fewer before replicas are removed")
    g.add_argument("--margin", type=float, default=0.1,
                   help="scale down only if the replicas left stay under the target utilisation minus this")
    g.add_argument("--down-step", type=float, default=0.1,
                   help="the most replicas one step down removes, as a share of the count (always at least one)")


def planner_config(args: argparse.Namespace, proxy_url: str, internal_key: str | None, window: float,
                   timeout: float = 2.0, all_addresses: bool = False, record: str | None = None) -> PlannerConfig:
    """The PlannerConfig of these flags; AssertionError naming what is wrong (the caller makes it a usage error)."""
    targets = Targets(args.ttft_slo, args.itl_slo, args.target_utilization, args.kv_high, args.queue_share)
    bounds = Bounds(**{f"{e}_{plural}": getattr(args, f"{e}_{plural}") for plural in FLAG.values()
                       for e in ("min", "max")})
    cfg = PlannerConfig(proxy_url.rstrip("/"), internal_key, window, timeout, all_addresses, targets, bounds,
                        args.up_windows, args.down_windows, args.margin, record, args.down_step)
    cfg.hysteresis()  # its checks
    return cfg
