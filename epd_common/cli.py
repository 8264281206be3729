"""Flags every worker takes."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from connector.security import (
    ENV_ALLOWED_CLIENTS,
    ENV_SECRET_KEY,
    ENV_SERVER_KEY,
    CurveConfig,
    load_curve_config,
)

T = TypeVar("T")


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def device_arg(value: str) -> str:
    """--device: auto (cuda if available, else cpu), cpu, cuda, cuda:N -> the resolved device, e.g. 'cuda:0'."""
    from epd_models.halves import resolve_device  # NOTE: local import: torch is loaded only when parsing

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
                   help="callers (the proxy) must send `Authorization: Bearer <key>` on the work endpoints; "
                        "prefer env EPD_INTERNAL_KEY (argv is visible to other local users). Required unless --insecure")
    p.add_argument("--insecure", action="store_true", default=_env_flag("EPD_INSECURE"),
                   help="start without the internal key and/or CURVE keys (work endpoints and ZeroMQ open to anyone "
                        "who can reach them; logs a WARNING). Env EPD_INSECURE=1. Only for a trusted single-user host")
    add_http_flags(p, defaults)
    return p


def add_http_flags(p: argparse.ArgumentParser, defaults: Any) -> None:
    """The HTTP server's limits (epd_common/http.py HttpLimits), with the defaults of the service's config class
    (or instance: its class's field defaults, so a default resolved by mode, 0, stays 0 here)."""
    d = {f.name: f.default for f in dataclasses.fields(defaults)}
    g = p.add_argument_group("HTTP server limits")
    g.add_argument("--max-body-bytes", type=int, default=d["max_body_bytes"],
                   help="request body bytes, counted as received (chunked or not); 413 above"
                        + (" (0: by mode)" if d["max_body_bytes"] == 0 else ""))
    g.add_argument("--body-read-timeout", type=float, default=d["body_read_timeout"],
                   help="seconds to receive a whole request body; 408 after")
    g.add_argument("--header-timeout", type=float, default=d["header_timeout"],
                   help="seconds to receive a request's headers (from connect, or the first byte on a kept-alive "
                        "connection); the connection is closed after (slow-header clients)")
    g.add_argument("--limit-concurrency", type=int, default=d["limit_concurrency"],
                   help="open connections + requests in progress; beyond it requests get 503 (0: no limit)")
    g.add_argument("--timeout-keep-alive", type=int, default=d["timeout_keep_alive"],
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--max-header-bytes", type=int, default=d["max_header_bytes"],
                   help="request line + headers; larger gets a 431 (400 when sent in pieces) and the "
                        "connection closed")
    g.add_argument("--backlog", type=int, default=d["backlog"], help="connections queued before accept")
    g.add_argument("--send-timeout", type=float, default=d["send_timeout"],
                   help="seconds a response may wait on a client that reads nothing (its window full); then the "
                        "connection is dropped and its generation stopped")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_INTERNAL_KEY = ("an internal key (env EPD_INTERNAL_KEY or --internal-key)",
                 "its work endpoint accepts calls from anyone who can reach its HTTP port")
_CURVE_NEEDS = {  # CurveConfig field -> (what is missing, what is open without it)
    "secret_key": (f"a CURVE secret key (--ec-curve-key FILE or env {ENV_SECRET_KEY})",
                   "its ZeroMQ links are unauthenticated and unencrypted"),
    "allowed_clients": (f"the CURVE client keys allowed in (--ec-curve-allowed-clients DIR or env {ENV_ALLOWED_CLIENTS})",
                        "anyone who can reach its ZeroMQ sockets can get every embedding and use has, snapshot and "
                        "the cache events"),
    "server_key": (f"the encoders' CURVE public key (--ec-curve-server-key FILE or env {ENV_SERVER_KEY})",
                   "embeddings it gathers can be read or forged on the way"),
}


def security_gaps(cfg: Any) -> list[tuple[str, str]]:
    """(what is missing, what is open) for a worker config: the internal key, and the CURVE keys its role needs
    (`cfg.curve_needs`: the CurveConfig fields it must have)."""
    gaps = [] if getattr(cfg, "internal_key", None) else [_INTERNAL_KEY]
    curve = getattr(cfg, "curve", None)
    gaps += [_CURVE_NEEDS[n] for n in getattr(cfg, "curve_needs", ()) if curve is None or getattr(curve, n) is None]
    return gaps


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
    cfg = config_cls(**vars(args), curve=curve)
    gaps = security_gaps(cfg)
    if gaps and not getattr(cfg, "insecure", False):
        p.error("refusing to start without " + "; ".join(g[0] for g in gaps) + ". Make keys with `epd-ec-keygen env DIR` "
                "and see docs/SECURITY.md, or pass --insecure (env EPD_INSECURE=1) to run open on a trusted host")
    return cfg


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
    from epd_common.http import HttpLimits, serve  # NOTE: local import keeps argument parsing free of the web stack
    from epd_common.logs import setup_logging

    setup_logging(role, cfg.log_level)
    log = logging.getLogger(f"epd.{role}")
    log.info("config: %s", describe(cfg))
    gaps = security_gaps(cfg)
    if gaps:
        log.warning("INSECURE %s (--insecure): started without %s. Open: %s", role, "; ".join(g[0] for g in gaps),
                    "; ".join(g[1] for g in gaps))
    serve(create_app(cfg), cfg.host, cfg.port, cfg.log_level, HttpLimits.of(cfg))
