"""`epd-planner`: how many encoders, prefill workers and decoders the fleet behind a proxy needs.

--once reads it twice a window apart and prints the plan; --replay FILE prints the plan of every window of a
recorded trace (no network); otherwise it serves the plan as Prometheus gauges on --port, re-deciding every
window. --record FILE appends every read to a trace. Parses before anything heavy loads; loads no torch."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from epd_common.cli import add_log_level, cli_secret, new_parser
from epd_common.startup import ConfigError, run_main
from epd_planner.flags import (
    add_bound_flags,
    add_hysteresis_flags,
    add_target_flags,
    planner_config,
    positive_seconds,
)
from epd_planner.model import FLAG
from epd_planner.planner import PlannerConfig
from epd_planner.sample import Sample, read_trace

PROG = "epd-planner"
DEFAULT_PORT = 9400
DEFAULT_MAX = 16


def build_parser() -> argparse.ArgumentParser:
    p = new_parser(PROG, __doc__ or "")
    g = p.add_argument_group("what to read")
    g.add_argument("--proxy-url", default="http://127.0.0.1:8000", help="the proxy's base URL (make run's)")
    g.add_argument("--internal-key", default=cli_secret("EPD_INTERNAL_KEY"),
                   help="the proxy's internal key, sent as `Authorization: Bearer <key>` (its GET /instances needs it "
                        "unless it runs --insecure); prefer env EPD_INTERNAL_KEY or EPD_INTERNAL_KEY_FILE (default: "
                        "env EPD_INTERNAL_KEY)")
    g.add_argument("--all-proxy-addresses", action="store_true",
                   help="read every address the proxy URL's host resolves to and add their metrics up (a "
                        "Kubernetes headless Service of several proxy replicas)")
    g.add_argument("--window", type=positive_seconds, default=30.0, help="seconds between two reads: one decision")
    g.add_argument("--timeout", type=positive_seconds, default=2.0, help="seconds one HTTP read may take")
    add_target_flags(p.add_argument_group("targets"))
    b = p.add_argument_group("bounds and hysteresis")
    add_bound_flags(b, {role: (0 if role == "prefill" else 1, DEFAULT_MAX) for role in FLAG})
    add_hysteresis_flags(b)
    m = p.add_argument_group("mode")
    m.add_argument("--once", action="store_true", help="read twice, --window seconds apart, print the plan, exit")
    m.add_argument("--record", metavar="FILE", help="append every read to FILE, a JSON line each (a trace)")
    m.add_argument("--replay", metavar="FILE", help="print the plan of every window of a recorded trace; no network")
    m.add_argument("--host", default="127.0.0.1", help="address the gauge server binds (serving mode)")
    m.add_argument("--port", type=int, default=DEFAULT_PORT, help="port of the gauge server (serving mode)")
    add_log_level(m, "info")
    return p


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, PlannerConfig]:
    p = build_parser()
    args = p.parse_args(argv)
    if args.replay and (args.once or args.record):
        p.error("--replay reads a trace: it takes neither --once nor --record")
    try:
        cfg = planner_config(args, args.proxy_url, args.internal_key, args.window, args.timeout,
                             args.all_proxy_addresses, args.record)
    except AssertionError as exc:
        p.error(str(exc))
    return args, cfg


def _main(argv: list[str]) -> None:
    args, cfg = parse_args(argv)
    from epd_planner.planner import once, replay
    from epd_planner.report import render

    if args.replay:
        for i, step in enumerate(replay(_trace(args.replay), cfg), 1):
            print(f"== window {i}", render(step.decision, cfg.targets, step.recommended), sep="\n", flush=True)
    elif args.once:
        step = once(cfg)
        print(render(step.decision, cfg.targets, step.recommended), flush=True)
    else:
        _serve(args, cfg)


def _trace(path: str) -> list[Sample]:
    try:
        with open(path, encoding="utf-8") as f:
            return read_trace(f.read())
    except OSError as exc:
        raise ConfigError(f"--replay: cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--replay: {path} is not a trace epd-planner --record wrote: {exc}") from None


def _serve(args: argparse.Namespace, cfg: PlannerConfig) -> None:
    from epd_common.logs import setup_logging
    from epd_common.server import serve  # NOTE: local imports keep --help and flag errors free of the web stack
    from epd_planner.planner import Planner
    from epd_planner.server import create_app

    setup_logging("planner", args.log_level)
    serve(create_app(Planner(cfg)), args.host, args.port, args.log_level)


def main(argv: Sequence[str] | None = None) -> None:
    run_main(PROG, _main, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
