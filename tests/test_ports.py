"""tests/ports.py: a test server's port is never free from the pick on, so no other program on a busy machine can
take it before the server binds it (once seen: a port picked free, then closed, was taken: Errno 98).
Before, tests picked with epd_launcher.group.free_port (bind, read, close): the port was free again at once."""
from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from tests.ports import HOST, bound_socket, held_port, port_of, serve_in_thread


def _plain(port: int) -> None:
    with socket.socket() as s:
        s.bind((HOST, port))
        s.listen()


def _reuse_addr(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, port))


def _asyncio_server(port: int) -> None:
    """As uvicorn and most asyncio servers bind (SO_REUSEADDR, then listen)."""
    async def bind() -> None:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, HOST, port)
        server.close()
        await server.wait_closed()

    asyncio.run(bind())


TAKERS: tuple[Callable[[int], None], ...] = (_plain, _reuse_addr, _asyncio_server)


def refused_binds(port: int) -> list[str]:
    """The ways another program binds a port that fail here with EADDRINUSE."""
    refused = []
    for take in TAKERS:
        try:
            take(port)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                refused.append(take.__name__)
    return refused


ALL_REFUSED = [t.__name__ for t in TAKERS]


def test_an_in_process_servers_port_cannot_be_taken_from_the_pick_through_startup_and_serving() -> None:
    seen_in_startup: list[list[str]] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        seen_in_startup.append(await asyncio.to_thread(refused_binds, port))  # bound, not listening yet
        yield

    app = FastAPI(lifespan=lifespan)
    app.get("/health")(lambda: {"status": "ok"})
    sock = bound_socket()
    port = port_of(sock)
    assert refused_binds(port) == ALL_REFUSED  # picked: uvicorn has not started
    with serve_in_thread(uvicorn.Config(app, host=HOST, port=0, log_level="warning"), sock) as served:
        assert served == port and httpx.get(f"http://{HOST}:{port}/health", timeout=10).json() == {"status": "ok"}
        assert refused_binds(port) == ALL_REFUSED  # listening
    assert seen_in_startup == [ALL_REFUSED]


def test_a_held_port_refuses_connections_and_cannot_be_taken() -> None:
    with held_port() as port:
        assert refused_binds(port) == ALL_REFUSED
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{HOST}:{port}/health", timeout=10)
