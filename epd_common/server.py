"""Running uvicorn with EPD's server-side limits: body, header and send deadlines, header size, connections, and
the drain on shutdown.

`HttpLimits` is the one declaration of those limits (every service config inherits it); `serve` runs an app under
them until SIGINT/SIGTERM, on its own socket or on one made by `reuseport_socket` (several processes on one port).
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    HAVE_HTTPTOOLS = True
except ImportError:  # pragma: no cover - httptools is a dependency; h11 serves without it
    HttpToolsProtocol = H11Protocol  # type: ignore[misc, assignment]
    HAVE_HTTPTOOLS = False

from epd_common.admission import Admit, GracefulServer
from epd_common.errors import APIError
from epd_common.http import closing_response
from epd_common.port_listeners import ExclusiveListenSocket

logger = logging.getLogger("epd.http")


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


class _Deadlines:
    """A deadline for a request's headers and one for a client that reads nothing, for uvicorn's HTTP protocols.

    uvicorn (0.54) has no such timer: its keep-alive timer runs only after a response and is cancelled by
    the first byte received, so a client that opens a connection and sends nothing, or sends its headers one
    byte every few seconds (slowloris), holds the connection forever. Here the clock starts when the
    connection opens, or at the first byte of the next request on a kept-alive one, and stops when the
    request's headers are complete; at `header_timeout` the connection is closed.

    A client that stops reading (its receive window full) pauses our writes; a response then waits in
    `drain()` forever, holding its generation (the proxy) or its stream (a worker). If writing stays paused
    for `send_timeout`, the connection is aborted (not closed: close() would wait to flush to a client that
    never reads): the app sees a disconnect, which stops the generation like any client that went away.

    Every request passes `Admit` (epd_common/admission.py: --limit-concurrency, the drain) and the header cap first.
    --limit-concurrency counts requests, not connections: a socket that sends nothing holds no request slot (eight
    idle sockets used to make every request and /health a 503, issue 44 item 5). Such connections are bounded per
    source address instead (`max_pending_per_ip`, epd_common.admission.PendingConnections): past the bound the
    oldest of that address's connections that have not yet sent a complete request head is closed, so an address
    that floods idle sockets closes its own, and a new client's connection, which sends its head at once, stays.

    Mixed in before a uvicorn protocol class, which supplies `loop`, `transport`, `client`, `server_state` and the
    callbacks; the protocol's own subclass says whether the current request's headers are still incomplete
    (`_headers_pending`).
    """

    header_timeout = 10.0
    max_header_bytes = 16 << 10
    send_timeout = 60.0
    concurrency_limit = 0  # NOTE: not `limit_concurrency`: uvicorn's protocols set that one from its config (None)
    max_pending_per_ip = 0  # connections of one address with no complete request head yet (0: no bound)
    _pending_source: str | None = None  # the address it is counted under while it has sent no complete head
    _header_timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: Any
    app: ASGIApp
    server_state: ServerState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = Admit(_HeaderCap(self.app, self.max_header_bytes), self.concurrency_limit, self.server_state)

    def _headers_pending(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_timer()
        if self.max_pending_per_ip and self.client:
            self._pending_source = str(self.client[0])
            pending = self.server_state.pending  # type: ignore[attr-defined]  # a DrainState (Admit checks it)
            evicted = pending.add(self._pending_source, self, self.max_pending_per_ip)
            if evicted is not None:
                evicted._evict()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self._headers_pending():  # bytes of a request whose headers are not complete yet
            self._arm_header_timer()
        else:
            self._disarm_header_timer()
            self._leave_pending()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._disarm_send_timer()
        self._leave_pending()
        super().connection_lost(exc)  # type: ignore[misc]

    def _leave_pending(self) -> None:
        """Its first request's head is complete (or it closed): no longer counted against its address's bound."""
        if self._pending_source is not None:
            self.server_state.pending.remove(self._pending_source, self)  # type: ignore[attr-defined]
            self._pending_source = None

    def _evict(self) -> None:
        """Closed to make room: the oldest of its address's connections that have sent no complete request head."""
        self._pending_source = None  # PendingConnections.add has dropped it already
        if not self.transport.is_closing():
            self.transport.abort()  # nothing to flush: it sent nothing we answer

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_timeout_expired)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        self._disarm_send_timer()

    def _disarm_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timeout_expired(self) -> None:
        self._send_timer = None
        if not self.transport.is_closing():
            logger.warning("dropping a connection from %s: it read nothing for %g s", self.client, self.send_timeout)
            self.transport.abort()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and self._headers_pending():
            logger.warning("closing a connection from %s: no complete request headers within %g s",
                           self.client, self.header_timeout)
            self.transport.close()


class _DeadlinesH11(_Deadlines, H11Protocol):
    """uvicorn's h11 protocol with the deadlines; h11 caps the unfinished head (`h11_max_incomplete_event_size`)."""

    def _headers_pending(self) -> bool:
        return self.conn.their_state is h11.IDLE


class _DeadlinesHttpTools(_Deadlines, HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp, C: measured 20 % more proxy requests per CPU second than h11) with the
    deadlines, and the header cap h11 has built in: an unfinished head past `max_header_bytes` at the end of a read
    is a 431 and the connection is closed, so a head sent in pieces never holds more than the cap plus one read.
    A head that arrives whole is judged by _HeaderCap like h11's."""

    _headers_done = False  # the current request's head is complete (none started yet: pending)
    _head_bytes = 0  # bytes of the current request's target and headers so far

    def _headers_pending(self) -> bool:
        return not self._headers_done

    def on_message_begin(self) -> None:
        self._headers_done, self._head_bytes = False, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._headers_done = True
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._headers_done and self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
            error = APIError(431, f"request headers are larger than {self.max_header_bytes} bytes",
                             code="headers_too_large")
            body = json.dumps(error.body()).encode()
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()


class _HeaderCap:
    """Pure ASGI: a 431 for a request line + headers over the cap. h11's own cap (max incomplete event size)
    only counts headers still incomplete in its buffer, so a request whose headers arrive in one read (up to
    asyncio's 256 KiB) passes it; this counts them whole."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope["raw_path"]) + len(scope["query_string"]) + sum(
                len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.max_bytes:
                error = APIError(431, f"request headers are larger than {self.max_bytes} bytes",
                                 code="headers_too_large")
                return await closing_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


def http_protocol(limits: HttpLimits, http: str = "auto") -> type[H11Protocol | HttpToolsProtocol]:
    """The HTTP protocol class with these deadlines and header cap (uvicorn takes a class, not an instance):
    httptools when it is installed (a dependency: `auto`), else h11; `http` names one."""
    base: type[_Deadlines] = _DeadlinesHttpTools if http == "httptools" or (http == "auto" and HAVE_HTTPTOOLS) \
        else _DeadlinesH11
    return type(f"Deadlines{base.__name__.removeprefix('_Deadlines')}", (base,),
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
