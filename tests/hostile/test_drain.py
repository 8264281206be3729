"""SIGTERM's drain (epd_common/admission.py GracefulServer, as `serve` runs it): a stream in flight finishes while
every new request gets a 503 `shutting_down` OpenAI body; past --shutdown-timeout the stream is cut and the server
exits."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from epd_common.admission import DrainState, GracefulServer
from epd_common.errors import install_error_handlers
from epd_common.server import HttpLimits, uvicorn_config
from tests.hostile.http_client import connect
from tests.ports import bound_socket, port_of

WITHIN_S = 30.0  # bounds a failing test only; every wait below ends on the event it waits for


def streaming_app(release: threading.Event, events: list[str]) -> FastAPI:
    """GET /stream sends `first`, then `last` once `release` is set; GET /ping answers at once."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                yield b"first\n"
                while not release.is_set():  # a generation between tokens (never a thread: cancellable)
                    await asyncio.sleep(0.01)
                yield b"last\n"
            finally:
                events.append("stream closed")

        return StreamingResponse(body())

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"status": "ok"}

    return app


@contextmanager
def running(app: FastAPI, limits: HttpLimits) -> Iterator[tuple[GracefulServer, int, threading.Thread]]:
    sock = bound_socket()
    server = GracefulServer(uvicorn_config(app, "127.0.0.1", 0, "warning", limits))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    until(lambda: server.started, "the server started")
    try:
        yield server, port_of(sock), thread
    finally:
        server.should_exit = True
        thread.join(WITHIN_S)
        sock.close()


def until(check: object, what: str) -> None:
    deadline = time.monotonic() + WITHIN_S
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {WITHIN_S} s: {what}"
        time.sleep(0.01)


def open_stream(port: int) -> socket.socket:
    """A GET /stream whose first chunk has arrived."""
    sock = connect(port)
    sock.sendall(f"GET /stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    received = b""
    while b"first" not in received:
        received += sock.recv(4096)
    return sock


def rest(sock: socket.socket) -> bytes:
    """Everything the server sends until the chunked body ends or the connection closes."""
    data = b""
    while not data.endswith(b"0\r\n\r\n") and (chunk := sock.recv(4096)):
        data += chunk
    return data


def test_a_stream_in_flight_finishes_while_new_requests_get_503() -> None:
    release, events = threading.Event(), []
    with running(streaming_app(release, events), HttpLimits(shutdown_timeout=WITHIN_S)) as (server, port, thread):
        with open_stream(port) as stream:
            server.should_exit = True  # what SIGTERM does (uvicorn's handler)
            state = server.server_state
            until(lambda: isinstance(state, DrainState) and state.draining, "the drain started")
            refused = httpx.get(f"http://127.0.0.1:{port}/ping", timeout=WITHIN_S)
            assert refused.status_code == 503 and refused.headers["connection"] == "close"
            error = refused.json()["error"]
            assert error == {"message": error["message"], "type": "service_unavailable_error", "param": None,
                             "code": "shutting_down"}
            assert thread.is_alive() and events == []  # the stream is still being served
            release.set()
            assert b"last\n" in rest(stream) and events == ["stream closed"]
        thread.join(WITHIN_S)
        assert not thread.is_alive()


def test_a_stream_past_the_shutdown_timeout_is_cut_and_the_server_exits() -> None:
    release, events = threading.Event(), []
    limits = HttpLimits(shutdown_timeout=0.2)
    with running(streaming_app(release, events), limits) as (server, port, thread), open_stream(port) as stream:
        started = time.monotonic()
        server.should_exit = True
        thread.join(WITHIN_S)
        assert not thread.is_alive() and time.monotonic() - started >= limits.shutdown_timeout
        assert b"last" not in rest(stream) and events == ["stream closed"]  # cut: its generator was closed
        release.set()
