"""uvicorn's HTTP protocols with EPD's per-connection guards: a deadline for a request's headers, one for a client
that reads nothing, the header cap, admission (epd_common/admission.py) and the bound on one address's connections
that have sent no complete request head."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    HAVE_HTTPTOOLS = True
except ImportError:  # pragma: no cover - httptools is a dependency; h11 serves without it
    HttpToolsProtocol = H11Protocol  # type: ignore[misc, assignment]
    HAVE_HTTPTOOLS = False

from epd_common.admission import Admit
from epd_common.errors import APIError
from epd_common.http import closing_response

logger = logging.getLogger("epd.http")


class Deadlines:
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
    --limit-concurrency counts requests, not connections: a socket that sends nothing holds no request slot (when they
    did, eight idle sockets made every request and /health a 503). Such connections are bounded per
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


class DeadlinesH11(Deadlines, H11Protocol):
    """uvicorn's h11 protocol with the deadlines; h11 caps the unfinished head (`h11_max_incomplete_event_size`)."""

    def _headers_pending(self) -> bool:
        return self.conn.their_state is h11.IDLE


class DeadlinesHttpTools(Deadlines, HttpToolsProtocol):
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
