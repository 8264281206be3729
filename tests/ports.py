"""Ports for the tests' servers that no other program on the machine can take between the pick and the bind
(once seen: a port picked free, then closed, was taken before the server bound it: [Errno 98]).

- A server in this process (uvicorn in a thread): bind its socket first, on a fresh port, and serve on that socket
  (`serve_in_thread`): the port is never free between the pick and the bind.
- A server in a child process: hold the port (`PortHolds.take`: epd_launcher.group.reserve_port, bound with
  SO_REUSEPORT, never listening) for the child's whole life, and start the child with EPD_REUSE_PORT=1
  (`REUSE_PORT_ENV`), so it binds beside the hold (epd_common.server.serve), after a restart too.
- A URL nobody listens on: a held port (connections are refused, and nobody else can start listening there).
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import TracebackType

import pytest
import uvicorn

from epd_common.admission import GracefulServer
from epd_common.server import ENV_REUSE_PORT
from epd_launcher.group import reserve_port

HOST = "127.0.0.1"
REUSE_PORT_ENV = {ENV_REUSE_PORT: "1"}  # a child's environment: bind beside the hold on its --port


class PortHolds:
    """Ports held (reserve_port) until `close()` / the end of the `with` block: for child processes started with
    REUSE_PORT_ENV, and for URLs that must stay dead."""

    def __init__(self) -> None:
        self._holds = ExitStack()

    def take(self, host: str = HOST) -> int:
        return int(self._holds.enter_context(reserve_port(host)).getsockname()[1])

    def close(self) -> None:
        self._holds.close()

    def __enter__(self) -> PortHolds:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


@contextmanager
def held_port(host: str = HOST) -> Iterator[int]:
    """One port held for the block."""
    with PortHolds() as holds:
        yield holds.take(host)


def bound_socket(host: str = HOST) -> socket.socket:
    """A TCP socket bound to a fresh port of `host`, not listening yet (uvicorn listens once the app has started).

    NOTE: no SO_REUSEADDR (nor SO_REUSEPORT): two sockets that both set it may bind one port while neither listens,
    so a stranger's bind (asyncio sets it) would get in during the app's startup; proto TCP as uvicorn's own bind
    (asyncio turns Nagle off only on accepted sockets whose proto says TCP: epd_common.server.reuseport_socket)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


@contextmanager
def serve_in_thread(config: uvicorn.Config, sock: socket.socket | None = None,
                    timeout: float = 30.0) -> Iterator[int]:
    """`config`'s app served by uvicorn in a daemon thread on `sock` (default: a fresh `bound_socket`; config's
    host and port are not bound), once it has started; yields the port; stops the server (and closes the socket)
    at the end. The server is `serve`'s (epd_common.admission.GracefulServer)."""
    sock = sock if sock is not None else bound_socket()
    server = GracefulServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:  # readiness, not a fixed sleep
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            pytest.fail(f"server did not start within {timeout} s")
        time.sleep(0.01)
    try:
        yield port_of(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
