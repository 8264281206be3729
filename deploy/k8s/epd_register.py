#!/usr/bin/env python3
"""Register this worker with every proxy (POST /instances), keep it registered, deregister on the way out.

Runs beside an encoder or decoder (a sidecar in the same pod, so the worker is reachable at the pod's IP),
standard library only. Every `--interval` seconds, while the worker's own /health answers 200, it POSTs
`{"role": ROLE, "url": URL}` to each address the proxy host name resolves to: with a headless Service that
is every proxy replica, and a proxy that restarted (and forgot its workers) gets the worker back within an
interval. On SIGTERM it DELETEs the same body from each proxy and exits 0; `deregister` does only that
(a preStop hook, so the proxy stops routing to the worker before the worker gets its SIGTERM).

    epd-register --role encoder --url http://$(POD_IP):8001 --proxy http://epd-proxy-workers:8000
    epd-register deregister --role encoder --url http://$(POD_IP):8001 --proxy http://epd-proxy-workers:8000

The key for the proxy's internal endpoints comes from EPD_INTERNAL_KEY (never a flag: argv is visible to
every process on the node).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request

logger = logging.getLogger("epd.register")


def proxy_bases(proxy: str) -> list[str]:
    """`http://name:port` -> one base URL per address the name resolves to (empty when it does not resolve)."""
    parts = urllib.parse.urlsplit(proxy)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        logger.warning("cannot resolve %s: %s", parts.hostname, exc)
        return []
    addrs = dict.fromkeys(str(info[4][0]) for info in infos)  # deduplicated, in resolver order
    return [f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{port}" for a in addrs]


def call(method: str, url: str, key: str | None, body: dict[str, str] | None = None, timeout: float = 5.0) -> int:
    """HTTP status of one request (0 when it could not be sent)."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except (urllib.error.URLError, OSError) as exc:
        logger.debug("%s %s: %s", method, url, exc)
        return 0


# A proxy answers 409 to a POST of a worker it already has, and 404 to a DELETE of one it does not.
_ALREADY = {"POST": 409, "DELETE": 404}


def announce(method: str, args: argparse.Namespace, key: str | None) -> bool:
    """POST or DELETE this worker at every proxy; True when each one has (or no longer has) it."""
    body = {"role": args.role, "url": args.url}
    bases = proxy_bases(args.proxy)
    ok = bool(bases)
    for base in bases:
        status = call(method, f"{base}/instances", key, body)
        if not (200 <= status < 300 or status == _ALREADY[method]):
            ok = False
            logger.warning("%s %s/instances %s: %s", method, base, body, status or "unreachable")
    return ok


def run(args: argparse.Namespace, key: str | None, stop: threading.Event) -> None:
    registered = False
    while not stop.is_set():
        if call("GET", f"{args.url}/health", None) == 200:
            ok = announce("POST", args, key)
            if ok and not registered:
                logger.info("registered %s %s with %s", args.role, args.url, args.proxy)
            registered = registered or ok
        stop.wait(args.interval)
    announce("DELETE", args, key)
    logger.info("deregistered %s %s", args.role, args.url)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("epd-register", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("action", nargs="?", choices=["run", "deregister"], default="run")
    p.add_argument("--role", required=True, choices=["encoder", "decoder", "prefill"])
    p.add_argument("--url", required=True, help="this worker's base URL as the proxies reach it (the pod IP)")
    p.add_argument("--proxy", default=os.environ.get("EPD_PROXY_URL"),
                   help="proxy base URL; a name resolving to several addresses reaches each (env EPD_PROXY_URL)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between registrations")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.proxy:
        p.error("--proxy or EPD_PROXY_URL is required")
    args.url, args.proxy = args.url.rstrip("/"), args.proxy.rstrip("/")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s register: %(message)s")
    key = os.environ.get("EPD_INTERNAL_KEY") or None
    if args.action == "deregister":
        return 0 if announce("DELETE", args, key) else 1
    stop = threading.Event()
    # NOTE: set from another thread: the handler runs in this thread, which may hold the event's lock inside
    # stop.wait(), and Event.set() here would then wait for that lock forever (it hung a SIGTERM in CI)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=stop.set, name="epd-register-stop").start())
    run(args, key, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
