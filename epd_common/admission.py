"""Who a server lets in: a 503 `overloaded` past --limit-concurrency requests in progress, and a 503 `shutting_down`
to every new request while it drains after SIGTERM; both as OpenAI error bodies. Connections that have sent no
complete request head are bounded per source address (`PendingConnections`), not counted as requests.

uvicorn (0.55) answers past its limit_concurrency with a plain-text "Service Unavailable" from `service_unavailable`,
a function each protocol module imports by name. Rather than patch that global (every server in the process) or
override the private method that starts the app, uvicorn's own limit is left off and `Admit`, which the protocol puts
in front of the app (epd_common.http_protocol.Deadlines), counts the requests it let in itself. uvicorn's rule
also counted open connections, so sockets that sent nothing filled the limit and every request, /health included,
got a 503; here only requests whose head has arrived count, and the probes (/health, /ready) never wait on the
limit. Nothing here breaks silently when uvicorn renames a private.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.server import ServerState

from epd_common.errors import APIError
from epd_common.http import closing_response
from epd_common.port_listeners import ExclusiveListenSocket

logger = logging.getLogger("epd.http")
_DRAIN_POLL_S = 0.1  # as uvicorn's own wait for connections to close
PROBE_PATHS = frozenset({"/health", "/ready"})  # answered past --limit-concurrency (not while draining): cheap, and
# a probe refused for load would mark a busy server down
_EVICT_LOG_S = 10.0  # at most one warning per this many seconds about closed idle connections


class PendingConnections:
    """Connections that have sent no complete request head yet, per source address, oldest first; past `limit` for
    one address its oldest is dropped from the count and handed back to be closed."""

    def __init__(self) -> None:
        self.by_source: dict[str, dict[object, None]] = {}  # insertion ordered: the oldest first
        self.evicted = 0
        self._logged_at = float("-inf")

    def add(self, source: str, conn: object, limit: int) -> object | None:
        conns = self.by_source.setdefault(source, {})
        conns[conn] = None
        if len(conns) <= limit:
            return None
        oldest = next(iter(conns))
        del conns[oldest]
        self.evicted += 1
        if time.monotonic() - self._logged_at >= _EVICT_LOG_S:
            self._logged_at = time.monotonic()
            logger.warning("closed a connection from %s that sent no request: over %d such connections from one "
                           "address (--max-pending-connections-per-ip; %d closed so far)", source, limit,
                           self.evicted)
        return oldest

    def remove(self, source: str, conn: object) -> None:
        conns = self.by_source.get(source)
        if conns is not None:
            conns.pop(conn, None)
            if not conns:
                del self.by_source[source]

    def count(self, source: str) -> int:
        return len(self.by_source.get(source, ()))


class DrainState(ServerState):
    """uvicorn's per-server state, plus whether it drains, how many requests it let in are still running (all, and
    those counted against --limit-concurrency), and the connections that have sent no complete request head."""

    def __init__(self) -> None:
        super().__init__()
        self.draining = False
        self.num_admitted = 0
        self.num_limited = 0
        self.pending = PendingConnections()


class Admit:
    """Pure ASGI, one per connection: refuses a request with a closing 503 when the server drains, or when the
    requests in progress before it (probes not counted) reach `limit` (0: no limit); a probe is never refused for
    load."""

    def __init__(self, app: ASGIApp, limit: int, state: ServerState) -> None:
        assert isinstance(state, DrainState), "a server with epd_common.server's protocol runs as GracefulServer"
        self.app, self.limit, self.state = app, limit, state

    def refusal(self, probe: bool) -> APIError | None:
        if self.state.draining:
            return APIError(503, "server is shutting down: send the request to another instance", code="shutting_down")
        if self.limit and not probe and self.state.num_limited >= self.limit:
            logger.warning("refused a request: %d requests in progress (--limit-concurrency %d)",
                           self.state.num_limited, self.limit)
            return APIError(503, f"server is overloaded: {self.limit} requests in progress "
                                 "(--limit-concurrency); retry later", code="overloaded")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        probe = scope["path"] in PROBE_PATHS
        error = self.refusal(probe)
        if error is not None:
            return await closing_response(error)(scope, receive, send)
        counted = 0 if probe else 1
        self.state.num_admitted += 1
        self.state.num_limited += counted
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_admitted -= 1
            self.state.num_limited -= counted


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose shutdown drains first: still listening, it answers every new request 503
    `shutting_down` (a load balancer or client sees why and goes elsewhere, where a closed port would only be
    refused) until the requests it let in have finished, or `timeout_graceful_shutdown` (--shutdown-timeout)
    has passed; then uvicorn's own shutdown closes the port and cancels whatever still runs. `on_drain` is called
    as the drain begins (the first proxy process signals the others then, so all drain at once)."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.server_state = DrainState()
        self.on_drain = on_drain

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup; between the app's startup and listen(), an ExclusiveListenSocket (a worker beside its
        launcher's reservation) is SystemExit if another process listens on its port by then."""
        exclusive = [s for s in sockets or () if isinstance(s, ExclusiveListenSocket)]
        if exclusive:
            app_startup = self.lifespan.startup  # NOTE: uvicorn makes the lifespan in _serve, before startup()

            async def started_then_alone() -> None:
                await app_startup()
                for sock in exclusive:
                    sock.refuse_if_listened()

            self.lifespan.startup = started_then_alone
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state, loop = self.server_state, asyncio.get_running_loop()
        assert isinstance(state, DrainState)
        state.draining = True
        if self.on_drain is not None:
            self.on_drain()
        timeout = self.config.timeout_graceful_shutdown or 0.0
        deadline = loop.time() + timeout
        if state.num_admitted:
            logger.info("draining: %d request(s) in progress, up to %g s", state.num_admitted, timeout)
        while state.num_admitted and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        # NOTE: uvicorn's wait gets what is left of the one timeout
        self.config.timeout_graceful_shutdown = max(0.0, deadline - loop.time())  # type: ignore[assignment]
        await super().shutdown(sockets)
