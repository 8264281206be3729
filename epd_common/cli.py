"""Command-line pieces every EPD program shares: help that shows defaults, --version, --log-level, the HTTP
server's limits, and the flags every worker takes. Torch-free and connector-free: the bottom layer."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
Gap = tuple[str, str]  # (what is missing, what is open without it)
_INTERNAL_KEY: Gap = ("an internal key (env EPD_INTERNAL_KEY or EPD_INTERNAL_KEY_FILE, or --internal-key)",
                      "its work endpoint accepts calls from anyone who can reach its HTTP port")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it in words (env fallbacks:
    a key read from the environment is never printed)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "(default" in action.help:
            return action.help
        return super()._get_help_string(action)


def package_version() -> str:
    try:
        return metadata.version("disagg-epd")
    except metadata.PackageNotFoundError:  # a source tree run with `python -m`, never installed
        return "unknown (not installed)"


def new_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser whose --help shows every default, with --version; a flag is only ever its whole name (no
    abbreviations: `--num-encoder 2` is an error, not --num-encoders)."""
    p = argparse.ArgumentParser(prog, description=description, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    return p


def add_log_level(p: argparse._ActionsContainer, default: str) -> None:
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=default,
                   help="log verbosity (case-insensitive)")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(value: str) -> int:
    """A bytes flag: a whole number, or one with a unit (KiB, MiB, GiB, TiB; KB, MB, GB, TB; any case): `4GiB`,
    `1.5 GB`. Never negative."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{value!r}: not a byte size (a number, optionally with a unit: "
                                         "KiB, MiB, GiB, TiB, KB, MB, GB or TB)")
    return int(float(match.group(1)) * _UNITS[unit]) if "." in match.group(1) else int(match.group(1)) * _UNITS[unit]


def fraction(value: str) -> float:
    """A share flag: a number in (0, 1]."""
    number = float(value)
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"{value}: must be in (0, 1]")
    return number


def seconds(value: str) -> float:
    """A duration flag: a finite number of seconds, 0 or more."""
    number = float(value)
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"{value}: must be a number of seconds >= 0")
    return number


def positive_seconds(value: str) -> float:
    """A duration flag that must be > 0 (and finite)."""
    number = float(value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"{value}: must be a number > 0")
    return number


def non_negative(value: str) -> int:
    """An int flag that may be 0 but not below."""
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 0")
    return number


MAX_SECRET_FILE_BYTES = 64 * 1024


def env_secret(name: str, env: Mapping[str, str] = os.environ) -> str | None:
    """env[name], else the contents of the file named by env[name + "_FILE"] (how Docker and Kubernetes hand over
    secrets: a file under /run/secrets, never a value in `docker inspect`), stripped; None when neither is set or
    the value is empty. Both set, or a file that cannot be read, is a ValueError naming the variable."""
    value, path = env.get(name, "").strip(), env.get(f"{name}_FILE", "").strip()
    if value and path:
        raise ValueError(f"both {name} and {name}_FILE are set: give the key one way")
    if not path:
        return value or None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{name}_FILE: cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"{name}_FILE: {path} is over {MAX_SECRET_FILE_BYTES} bytes: not a key")
    try:
        return data.decode("ascii").strip() or None
    except UnicodeDecodeError:
        raise ValueError(f"{name}_FILE: {path} is not ASCII text: not a key") from None


def cli_secret(name: str) -> str | None:
    """env_secret for a flag's default: a bad variable stops the program with the reason (exit 2), no traceback."""
    try:
        return env_secret(name)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def worker_parser(prog: str, description: str, defaults: Any) -> argparse.ArgumentParser:
    """--model, --host, --port, --log-level, the internal key and the HTTP limits, with the worker config's
    defaults. The worker adds its device flags (epd_models.device_flags) and CURVE flags
    (connector.control.curve_flags)."""
    p = new_parser(prog, description)
    p.add_argument("--model", default=defaults.model, help="'demo', 'bench', a checkpoint directory, or a hub id")
    p.add_argument("--host", default=defaults.host, help="address the HTTP server binds")
    p.add_argument("--port", type=int, default=defaults.port, help="HTTP port")
    add_log_level(p, defaults.log_level)
    p.add_argument("--internal-key", default=cli_secret("EPD_INTERNAL_KEY"),
                   help="callers (the proxy) must send `Authorization: Bearer <key>` on the work endpoints; "
                        "prefer env EPD_INTERNAL_KEY, or EPD_INTERNAL_KEY_FILE naming a file that holds it (argv is "
                        "visible to other local users). Required unless --insecure (default: env EPD_INTERNAL_KEY)")
    p.add_argument("--insecure", action="store_true", default=env_flag("EPD_INSECURE"),
                   help="start without the internal key and/or CURVE keys (work endpoints and ZeroMQ open to anyone "
                        "who can reach them; logs a WARNING). Only for a trusted single-user host (default: env "
                        "EPD_INSECURE=1, else off)")
    add_http_flags(p, defaults)
    return p


def add_http_flags(p: argparse.ArgumentParser, defaults: Any) -> None:
    """The HTTP server's limits (epd_common/server.py HttpLimits), with the defaults of the service's config class
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
                   help="requests in progress (their headers arrived; /health and /ready not counted); beyond it "
                        "requests get 503 overloaded (0: no limit)")
    g.add_argument("--max-pending-connections-per-ip", type=int, default=d["max_pending_connections_per_ip"],
                   help="connections from one address that have not sent a complete request head yet; past it the "
                        "oldest of them is closed (default: --limit-concurrency; 0: no bound)")
    g.add_argument("--timeout-keep-alive", type=int, default=d["timeout_keep_alive"],
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--max-header-bytes", type=int, default=d["max_header_bytes"],
                   help="request line + headers; larger gets a 431 (400 when sent in pieces) and the "
                        "connection closed")
    g.add_argument("--backlog", type=int, default=d["backlog"], help="connections queued before accept")
    g.add_argument("--send-timeout", type=float, default=d["send_timeout"],
                   help="seconds a response may wait on a client that reads nothing (its window full); then the "
                        "connection is dropped and its generation stopped")
    g.add_argument("--shutdown-timeout", type=seconds, default=d["shutdown_timeout"],
                   help="seconds the requests in progress (streams included) may run after SIGTERM, while new "
                        "requests get 503 shutting_down; then they are cut and the server exits")


def key_gaps(cfg: Any) -> list[Gap]:
    """The internal-key gap of a worker config (the CURVE gaps: connector.control.curve_flags.curve_gaps)."""
    return [] if getattr(cfg, "internal_key", None) else [_INTERNAL_KEY]


def refuse_open(p: argparse.ArgumentParser, cfg: Any, gaps: list[Gap]) -> None:
    """A usage error for a worker that would start with gaps, unless its config says --insecure."""
    if gaps and not getattr(cfg, "insecure", False):
        p.error("refusing to start without " + "; ".join(g[0] for g in gaps) + ". Make keys with `epd-ec-keygen env "
                "DIR` and see docs/SECURITY.md, or pass --insecure (env EPD_INSECURE=1) to run open on a trusted host")


def describe(cfg: Any) -> dict[str, Any]:
    """A config for the log: keys are never printed, only whether CURVE is on."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    if "curve" in d:
        d["curve"] = "on" if d["curve"] is not None else "off"
    for secret in ("internal_key", "api_key"):
        if secret in d:
            d[secret] = "set" if d[secret] else "unset"
    return d


def run_worker(role: str, cfg: Any, create_app: Callable[[Any], Any], gaps: list[Gap]) -> None:
    """Log setup, the (key-free) config and what is open, then serve the worker's app until SIGINT/SIGTERM."""
    from epd_common.logs import setup_logging
    from epd_common.server import HttpLimits, serve  # NOTE: local import keeps argument parsing free of the web stack

    setup_logging(role, cfg.log_level)
    log = logging.getLogger(f"epd.{role}")
    log.info("config: %s", describe(cfg))
    if gaps:
        log.warning("INSECURE %s (--insecure): started without %s. Open: %s", role, "; ".join(g[0] for g in gaps),
                    "; ".join(g[1] for g in gaps))
    serve(create_app(cfg), cfg.host, cfg.port, cfg.log_level, HttpLimits.of(cfg))


def run_refusable(prog: str, role: str, cfg: Any, create_app: Callable[[Any], Any], gaps: list[Gap],
                  refused: Callable[[Any], str | None]) -> None:
    """run_worker; where start-up failed for a reason the app recorded (`refused(app)`: a K/V budget that cannot
    hold what was asked, a refused LoRA adapter), exit 2 with that line, as a usage error."""
    from epd_common.startup import fail

    apps: list[Any] = []

    def build(c: Any) -> Any:
        apps.append(create_app(c))
        return apps[-1]

    try:
        run_worker(role, cfg, build, gaps)
    except SystemExit:  # uvicorn's exit 3 when start-up failed
        why = refused(apps[0]) if apps else None
        if why is None:
            raise
        fail(prog, why)
