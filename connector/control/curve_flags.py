"""The CURVE key flags of the programs that open connector links (encoders, decoders, the proxy in attach mode)."""
from __future__ import annotations

import argparse
from typing import Any

from connector.control.security import (
    ENV_ALLOWED_CLIENTS,
    ENV_SECRET_KEY,
    ENV_SERVER_KEY,
    CurveConfig,
    load_curve_config,
)

GROUP = "connector security (ZeroMQ CURVE; see docs/SECURITY.md)"
_CURVE_NEEDS = {  # CurveConfig field -> (what is missing, what is open without it)
    "secret_key": (f"a CURVE secret key (--ec-curve-key FILE, or env {ENV_SECRET_KEY} or {ENV_SECRET_KEY}_FILE)",
                   "its ZeroMQ links are unauthenticated and unencrypted"),
    "allowed_clients": ("the CURVE client keys allowed in (--ec-curve-allowed-clients DIR or env "
                        f"{ENV_ALLOWED_CLIENTS} or {ENV_ALLOWED_CLIENTS}_FILE)",
                        "anyone who can reach its ZeroMQ sockets can get every embedding and use has, snapshot and "
                        "the cache events"),
    "server_key": (f"the encoders' CURVE public key (--ec-curve-server-key FILE, or env {ENV_SERVER_KEY} or "
                   f"{ENV_SERVER_KEY}_FILE)",
                   "embeddings it gathers can be read or forged on the way"),
}


def add_curve_flags(g: argparse._ActionsContainer, *, allowed_clients: bool) -> None:
    """Optional CURVE key files; each falls back to its EPD_EC_CURVE_* env var (or EPD_EC_CURVE_*_FILE, a file holding
    the key). Only encoders admit clients."""
    g.add_argument("--ec-curve-key", default=None,
                   help="this node's secret key file (`epd-ec-keygen generate DIR`) (default: env "
                        f"{ENV_SECRET_KEY}, or the file {ENV_SECRET_KEY}_FILE names)")
    g.add_argument("--ec-curve-server-key", default=None,
                   help=f"the encoders' public key file (decoders, proxies) (default: env {ENV_SERVER_KEY}, or the "
                        f"file {ENV_SERVER_KEY}_FILE names)")
    if allowed_clients:
        g.add_argument("--ec-curve-allowed-clients", default=None,
                       help="directory of the client public key files allowed in (default: env "
                            f"{ENV_ALLOWED_CLIENTS}, comma-separated keys, or the file {ENV_ALLOWED_CLIENTS}_FILE "
                            "names)")


def pop_curve(p: argparse.ArgumentParser, args: argparse.Namespace) -> CurveConfig | None:
    """Remove the CURVE flags from `args` and load the keys they name (a usage error if they are bad)."""
    d = vars(args)
    try:
        return load_curve_config(d.pop("ec_curve_key"), d.pop("ec_curve_server_key"),
                                 d.pop("ec_curve_allowed_clients", None))
    except (ValueError, OSError) as exc:
        p.error(str(exc))


def curve_gaps(cfg: Any) -> list[tuple[str, str]]:
    """(what is missing, what is open) for the CURVE keys a worker's role needs (`cfg.curve_needs`)."""
    curve = getattr(cfg, "curve", None)
    return [_CURVE_NEEDS[n] for n in getattr(cfg, "curve_needs", ()) if curve is None or getattr(curve, n) is None]
