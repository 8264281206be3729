"""Launcher mode's --autoscale flags: the planner's targets, bounds and hysteresis (epd_planner/flags.py), the window,
and what the bounds default to: each role's --min-* is its --num-*, the encoders' --max-encoders twice that (at
least one more), the decoders' and prefill workers' their --num-* (they load the whole language model: scaling
them is asked for, not assumed)."""
from __future__ import annotations

import argparse

from epd_common.cli import positive_seconds
from epd_planner.flags import add_bound_flags, add_hysteresis_flags, add_target_flags, planner_config
from epd_planner.model import FLAG
from epd_planner.planner import PlannerConfig

AUTOSCALE_FLAGS = ("--autoscale", "--autoscale-window", "--ttft-slo", "--itl-slo", "--target-utilization",
                   "--kv-high", "--queue-share", "--up-windows", "--down-windows", "--margin", "--down-step",
                   *(f"--{e}-{plural}" for plural in FLAG.values() for e in ("min", "max")))


def add_autoscale_flags(g: argparse._ActionsContainer) -> None:
    g.add_argument("--autoscale", action="store_true",
                   help="size the local fleet from its own metrics (epd-planner's rule): start an encoder, decoder "
                        "or prefill worker when the plan says so, drain and stop one when it says fewer, within "
                        "--min-* / --max-*")
    g.add_argument("--autoscale-window", type=positive_seconds, default=10.0,
                   help="seconds between two reads of the fleet: one autoscaling decision")
    add_target_flags(g)
    add_bound_flags(g, {role: (None, None) for role in FLAG},
                    note=" (default: --min-* its --num-*; --max-encoders twice --num-encoders, at least one more; "
                         "--max-decoders / --max-prefills their --num-*)")
    add_hysteresis_flags(g)


def resolve_bounds(args: argparse.Namespace) -> None:
    """Fill the --min-* / --max-* not given from the --num-* (see the module); ValueError when a start count is
    outside its bounds."""
    nums = {"encoder": 0 if args.aggregated else args.num_encoders, "decoder": args.num_decoders,
            "prefill": 0 if args.aggregated else args.num_prefills}
    for role, plural in FLAG.items():
        n = nums[role]
        if getattr(args, f"min_{plural}") is None:
            setattr(args, f"min_{plural}", n)
        if getattr(args, f"max_{plural}") is None:
            setattr(args, f"max_{plural}", max(2 * n, n + 1) if role == "encoder" and n else n)
        low, high = getattr(args, f"min_{plural}"), getattr(args, f"max_{plural}")
        if not low <= n <= high:
            raise ValueError(f"--num-{plural} {n} is outside --min-{plural} {low} .. --max-{plural} {high}")


def check_autoscale(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors of --autoscale (exit 2): flags it would ignore, combinations it cannot serve."""
    if not args.autoscale:
        given = [f for f in AUTOSCALE_FLAGS[1:] if getattr(args, f.removeprefix("--").replace("-", "_"))
                 != p.get_default(f.removeprefix("--").replace("-", "_"))]
        if given:
            p.error(f"{', '.join(given)} without --autoscale: they size an autoscaled fleet")
        return
    if args.proxy_workers > 1:
        p.error("--autoscale with --proxy-workers > 1: each proxy process keeps its own worker list, and a worker "
                "the launcher adds would be registered with one of them; use --proxy-workers 1")
    try:
        resolve_bounds(args)
    except ValueError as exc:
        p.error(str(exc))
    if (args.tensor_parallel_size or 1) > 1 and (args.max_decoders > args.num_decoders
                                                 or args.max_prefills > args.num_prefills):
        p.error("--autoscale with --tensor-parallel-size > 1 cannot add decoders or prefill workers (each needs GPUs "
                "of its own, placed at start); keep --max-decoders / --max-prefills at their --num-*")


def autoscale_config(args: argparse.Namespace, proxy_url: str, internal_key: str) -> PlannerConfig:
    return planner_config(args, proxy_url, internal_key, args.autoscale_window)
