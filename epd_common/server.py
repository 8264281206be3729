"""Running uvicorn with EPD's server-side limits: body, header and send deadlines, header size, connections, and
the drain on shutdown.

`HttpLimits` is the one declaration of those limits (every service config inherits it); `serve` runs an app under
them until SIGINT/SIGTERM, on its own socket or on one made by `reuseport_socket` (several processes on one port).
The per-connection deadlines and header cap are uvicorn protocol classes (epd_common/http_protocol.py).
"""
from __future__ import annotations

import gc
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from epd_common.admission import GracefulServer
from epd_common.http_protocol import HAVE_HTTPTOOLS, Deadlines, DeadlinesH11, DeadlinesHttpTools
from epd_common.port_listeners import ExclusiveListenSocket


@dataclass(frozen=True, kw_only=True)
class HttpLimits:
    """What one HTTP server lets a client hold: body bytes and time, header bytes and time, requests, connections.

    Every service's config inherits these fields (one declaration; `epd_common.cli.add_http_flags` makes the flags)
    and calls `super().__post_init__()` last."""

    max_body_bytes: int = 64 << 20  # request body, counted as received (chunked or not); 413 above
    body_read_timeout: float = 60.0  # seconds to receive a whole request body; 408 after
    header_timeout: float = 10.0  # seconds from a connection's first byte (or its opening) to a request's last header
    limit_concurrency: int = 2048  # requests in progress (headers arrived; not /health, /ready); 503 beyond (0: none)
    # connections from one address that have sent no complete request head yet; past it the oldest is closed
    # (None: limit_concurrency, a client never needs more at once: its requests past that would get 503s; 0: none)
    max_pending_connections_per_ip: int | None = None
    timeout_keep_alive: int = 5  # seconds an idle keep-alive connection is kept
    max_header_bytes: int = 16 << 10  # request line + headers: 431 above (400 when they arrive in pieces)
    backlog: int = 2048  # connections the kernel queues before accept
    send_timeout: float = 60.0  # seconds a response may wait on a client that reads nothing; then it is dropped
    shutdown_timeout: float = 30.0  # seconds requests in progress may run after SIGTERM (new ones: 503); then cut

    def __post_init__(self) -> None:
        assert self.max_body_bytes > 0 and self.max_header_bytes > 0 and self.backlog > 0, "limits must be > 0"
        assert self.body_read_timeout > 0 and self.header_timeout > 0 and self.timeout_keep_alive > 0
        assert self.send_timeout > 0, "send_timeout must be > 0"
        assert self.limit_concurrency >= 0, "limit_concurrency must be >= 0 (0: no limit)"
        assert (self.max_pending_connections_per_ip or 0) >= 0, "max_pending_connections_per_ip must be >= 0"
        assert self.shutdown_timeout >= 0, "shutdown_timeout must be >= 0"

    @property
    def pending_per_ip(self) -> int:
        """The bound on one address's connections that have sent no complete request head (0: none)."""
        given = self.max_pending_connections_per_ip
        return self.limit_concurrency if given is None else given

    @classmethod
    def of(cls, cfg: object) -> HttpLimits:
        """The limits named by a service config's fields of the same names (missing ones keep the default)."""
        names = cls.__dataclass_fields__
        return cls(**{n: getattr(cfg, n) for n in names if hasattr(cfg, n)})


def freeze_startup_heap() -> None:
    """Hide everything loaded at startup from the cyclic GC.

    A full collection scans every object the model and libraries created (measured: 210 ms for the small
    bench LM) and holds the GIL meanwhile, stalling the engine and serving threads; after this it has
    only the request-time objects to scan (measured: under 0.01 ms).
    """
    gc.collect()
    gc.freeze()


def http_protocol(limits: HttpLimits, http: str = "auto") -> type[DeadlinesH11 | DeadlinesHttpTools]:
    """The HTTP protocol class with these deadlines and header cap (uvicorn takes a class, not an instance):
    httptools when it is installed (a dependency: `auto`), else h11; `http` names one."""
    base: type[Deadlines] = DeadlinesHttpTools if http == "httptools" or (http == "auto" and HAVE_HTTPTOOLS) \
        else DeadlinesH11
    return type(f"Deadlines{base.__name__.removeprefix('Deadlines')}", (base,),
                {"header_timeout": limits.header_timeout, "max_header_bytes": limits.max_header_bytes,
                 "send_timeout": limits.send_timeout, "concurrency_limit": limits.limit_concurrency,
                 "max_pending_per_ip": limits.pending_per_ip})


def uvicorn_config(app: ASGIApp, host: str, port: int, log_level: str = "info",
                   limits: HttpLimits | None = None, http: str = "auto") -> uvicorn.Config:
    """uvicorn's config with the server-side limits (keep-alive, header size and time, backlog, shutdown time), for
    a GracefulServer. NOTE: uvicorn's limit_concurrency stays off: the protocol enforces it (epd_common.admission)."""
    lim = limits or HttpLimits()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=lim.shutdown_timeout,  # type: ignore[arg-type]  # float s is fine
                          access_log=False, http=http_protocol(lim, http), timeout_keep_alive=lim.timeout_keep_alive,
                          h11_max_incomplete_event_size=lim.max_header_bytes, backlog=lim.backlog)


# "1": the port was reserved by the process that started this one (a bound, never listening SO_REUSEPORT socket:
# epd_launcher.group.reserve_port), so the server binds it with SO_REUSEPORT beside that reservation, and refuses to
# start if another process already listens there (epd_common.port_listeners)
ENV_REUSE_PORT = "EPD_REUSE_PORT"


def reuseport_socket(host: str, port: int, exclusive: bool = False) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT: every process that binds one this way shares the port and
    the kernel spreads new connections over those listening. Not listening yet: uvicorn (asyncio) calls
    listen(backlog) once the app's startup is over, so a process still starting gets no connections.
    `exclusive`: the first of its group (a worker beside its launcher's reservation, the first proxy process):
    its listen() is SystemExit if another socket already listens on the port, whose group it would join."""
    # NOTE: proto IPPROTO_TCP, as getaddrinfo gives uvicorn's own bind: asyncio turns Nagle off only on accepted
    # sockets whose proto says TCP; with proto 0 every small write after the first waited for the client's
    # delayed ACK (measured: 46 ms median time to the first streamed bytes instead of 2 ms)
    kind = ExclusiveListenSocket if exclusive else socket.socket
    sock = kind(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(app: FastAPI, host: str, port: int, log_level: str = "info", limits: HttpLimits | None = None,
          sock: socket.socket | None = None, on_drain: Callable[[], None] | None = None) -> None:
    """Run uvicorn until SIGINT/SIGTERM; then new requests get 503 while those in flight finish (up to the limits'
    shutdown_timeout) before exit. `sock`: serve on this bound socket (e.g. `reuseport_socket`) instead of binding
    host:port here. `on_drain`: called as the drain after SIGTERM begins (GracefulServer)."""
    if sock is None and os.environ.get(ENV_REUSE_PORT) == "1":
        sock = reuseport_socket(host, port, exclusive=True)  # beside our launcher's hold (group.reserve_port)
    server = GracefulServer(uvicorn_config(app, host, port, log_level, limits), on_drain)
    server.run(sockets=None if sock is None else [sock])
