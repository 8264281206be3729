"""Who a server lets in: a 503 `overloaded` past --limit-concurrency, and a 503 `shutting_down` to every new request
while it drains after SIGTERM; both as OpenAI error bodies.

uvicorn (0.55) answers past its limit_concurrency with a plain-text "Service Unavailable" from `service_unavailable`,
a function each protocol module imports by name. Rather than patch that global (every server in the process) or
override the private method that starts the app, uvicorn's own limit is left off and `Admit`, which the protocol puts
in front of the app (epd_common.server._Deadlines), takes uvicorn's count the way uvicorn takes it: from the
connection and task sets uvicorn hands every protocol. Nothing here breaks silently when uvicorn renames a private.
"""
from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.server import ServerState

from epd_common.errors import APIError
from epd_common.http import closing_response
from epd_common.port_listeners import ExclusiveListenSocket

logger = logging.getLogger("epd.http")
_DRAIN_POLL_S = 0.1  # as uvicorn's own wait for connections to close


class DrainState(ServerState):
    """uvicorn's per-server state, plus whether it drains and how many requests it let in are still running."""

    def __init__(self) -> None:
        super().__init__()
        self.draining = False
        self.num_admitted = 0


class Admit:
    """Pure ASGI, one per connection: refuses a request with a closing 503 when the server drains, or when the open
    connections or the requests in progress before it reach `limit` (uvicorn's rule; 0: no limit)."""

    def __init__(self, app: ASGIApp, limit: int, state: ServerState) -> None:
        assert isinstance(state, DrainState), "a server with epd_common.server's protocol runs as GracefulServer"
        self.app, self.limit, self.state = app, limit, state

    def refusal(self) -> APIError | None:
        if self.state.draining:
            return APIError(503, "server is shutting down: send the request to another instance", code="shutting_down")
        # NOTE: this request's own task is in `tasks` already (uvicorn counted the others when it decided)
        over = self.limit and (len(self.state.connections) >= self.limit or len(self.state.tasks) - 1 >= self.limit)
        if over:
            logger.warning("refused a request: %d connections, %d requests in progress (--limit-concurrency %d)",
                           len(self.state.connections), len(self.state.tasks) - 1, self.limit)
            return APIError(503, f"server is overloaded: over {self.limit} connections and requests in progress "
                                 "(--limit-concurrency); retry later", code="overloaded")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self.refusal()
        if error is not None:
            return await closing_response(error)(scope, receive, send)
        self.state.num_admitted += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_admitted -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose shutdown drains first: still listening, it answers every new request 503
    `shutting_down` (a load balancer or client sees why and goes elsewhere, where a closed port would only be
    refused) until the requests it let in have finished, or `timeout_graceful_shutdown` (--shutdown-timeout)
    has passed; then uvicorn's own shutdown closes the port and cancels whatever still runs."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.server_state = DrainState()

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
        timeout = self.config.timeout_graceful_shutdown or 0.0
        deadline = loop.time() + timeout
        if state.num_admitted:
            logger.info("draining: %d request(s) in progress, up to %g s", state.num_admitted, timeout)
        while state.num_admitted and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        # NOTE: uvicorn's wait gets what is left of the one timeout
        self.config.timeout_graceful_shutdown = max(0.0, deadline - loop.time())  # type: ignore[assignment]
        await super().shutdown(sockets)
