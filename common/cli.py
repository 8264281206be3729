"""Flags every worker takes."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from connector.security import CurveConfig, load_curve_config

T = TypeVar("T")


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def device_arg(value: str) -> str:
    """--device: auto (cuda if available, else cpu), cpu, cuda, cuda:N -> the resolved device, e.g. 'cuda:0'."""
    from models.halves import resolve_device  # NOTE: local import: torch is loaded only when parsing

    try:
        return str(resolve_device(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def worker_parser(prog: str, description: str, defaults: Any) -> argparse.ArgumentParser:
    """--model, --device, --dtype, --host, --port and --log-level, with defaults from the worker's config."""
    p = argparse.ArgumentParser(prog, description=description)
    p.add_argument("--model", default=defaults.model, help="'demo', a checkpoint directory, or a hub id")
    p.add_argument("--device", type=device_arg, default=defaults.device,
                   help="where the model runs: auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=defaults.dtype,
                   help="weights' dtype; auto: the checkpoint's own (config.json dtype), float32 if it names none")
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--log-level", default=defaults.log_level)
    p.add_argument("--internal-key", default=os.environ.get("EPD_INTERNAL_KEY"),
                   help="callers (the proxy) must send `Authorization: Bearer <key>` on the work endpoints "
                        "(default: env EPD_INTERNAL_KEY; unset: open)")
    return p


def add_curve_flags(p: argparse.ArgumentParser) -> None:
    """Optional CURVE keys for connector links; each falls back to its EPD_EC_CURVE_* env var."""
    g = p.add_argument_group("connector security (ZeroMQ CURVE; see docs/ARCHITECTURE.md)")
    g.add_argument("--ec-curve-key", default=None,
                   help="this node's secret key file (`python -m connector.security generate DIR`); "
                        "env EPD_EC_CURVE_SECRET_KEY")
    g.add_argument("--ec-curve-server-key", default=None,
                   help="the encoders' public key file (decoders, proxies); env EPD_EC_CURVE_SERVER_KEY")
    g.add_argument("--ec-curve-allowed-clients", default=None,
                   help="encoders: directory of client public key files allowed in; env EPD_EC_CURVE_ALLOWED_CLIENTS")


def pop_curve(p: argparse.ArgumentParser, args: argparse.Namespace) -> CurveConfig | None:
    """Remove the CURVE flags from `args` and load the keys they name (a usage error if they are bad)."""
    d = vars(args)
    try:
        return load_curve_config(d.pop("ec_curve_key"), d.pop("ec_curve_server_key"), d.pop("ec_curve_allowed_clients"))
    except (ValueError, OSError) as exc:
        p.error(str(exc))


def parse_config(p: argparse.ArgumentParser, argv: list[str] | None, config_cls: Callable[..., T]) -> T:
    """Add the CURVE flags, parse, and build the worker's config dataclass from the flags."""
    add_curve_flags(p)
    args = p.parse_args(argv)
    curve = pop_curve(p, args)
    return config_cls(**vars(args), curve=curve)


def describe(cfg: Any) -> dict[str, Any]:
    """A config for the log: keys are never printed, only whether CURVE is on."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    if "curve" in d:
        d["curve"] = "on" if d["curve"] is not None else "off"
    for secret in ("internal_key", "api_key"):
        if secret in d:
            d[secret] = "set" if d[secret] else "unset"
    return d


def run_worker(role: str, cfg: Any, create_app: Callable[[Any], Any]) -> None:
    """Log setup, the (key-free) config, then serve the worker's app until SIGINT/SIGTERM."""
    from common.http import serve  # NOTE: local import keeps argument parsing free of the web stack
    from common.logs import setup_logging

    setup_logging(role, cfg.log_level)
    logging.getLogger(f"epd.{role}").info("config: %s", describe(cfg))
    serve(create_app(cfg), cfg.host, cfg.port, cfg.log_level)
