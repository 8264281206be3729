"""The HTTP limits every service shares (epd_common/http.py, epd_common/server.py), in process: body bytes counted as received, a body
deadline, a header deadline (slowloris), header size, requests in progress, and cancellation on disconnect."""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from epd_common.errors import install_error_handlers
from epd_common.http import install_body_limit, until_disconnected
from epd_common.server import HttpLimits
from tests.hostile.http_client import (
    closed_by_server,
    connect,
    flood_chunked,
    head,
    read_reply,
    served,
    trickle_body,
)
from tests.hostile.memory import rss_bytes

LIMITS = HttpLimits(max_body_bytes=1 << 20, body_read_timeout=1.0, header_timeout=1.0, max_header_bytes=4096,
                    send_timeout=1.0)
RSS_BOUND = 48 << 20  # a 1 MiB cap: the server holds at most the cap plus uvicorn's 64 KiB read-ahead


def echo_app(limits: HttpLimits, seen: list[int], streams: list[str] | None = None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    install_body_limit(app, limits.max_body_bytes, limits.body_read_timeout)

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        body = await request.body()
        seen.append(len(body))
        return {"num_bytes": len(body)}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def forever() -> AsyncIterator[bytes]:  # a generation that would run on as long as it is read
            try:
                while True:
                    await asyncio.sleep(0)  # as a generation awaits its next token
                    yield b"x" * (64 << 10)
            finally:
                if streams is not None:
                    streams.append("stopped")

        return StreamingResponse(forever())

    return app


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[int, list[int]]]:
    """Both HTTP protocols the services can run (httptools by default, h11 without it), under the same limits."""
    seen: list[int] = []
    with served(echo_app(LIMITS, seen), LIMITS, http=request.param) as port:
        yield port, seen


def ordinary(port: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/echo", content=b"[1, 2, 3]", timeout=30)


def test_a_chunked_flood_is_refused_once_it_passes_the_cap(server: tuple[int, list[int]]) -> None:
    port, seen = server
    before = rss_bytes()
    reply, sent = flood_chunked(port, "/echo", total=200 << 20)
    assert reply.status == 413 and reply.body is not None and reply.body["error"]["code"] == "body_too_large"
    assert reply.headers["connection"] == "close"
    assert sent < 200 << 20  # refused mid-body, not after it all arrived
    assert rss_bytes() - before < RSS_BOUND
    assert ordinary(port).json() == {"num_bytes": 9} and seen[-1] == 9  # the app never got the flood


def test_a_declared_length_over_the_cap_is_refused_before_the_body(server: tuple[int, list[int]]) -> None:
    port, _ = server
    with connect(port) as sock:
        sock.sendall(head("/echo", port, chunked=False, length=(1 << 20) + 1))  # headers only, no body
        reply = read_reply(sock)
    assert reply.status == 413 and reply.body is not None and reply.body["error"]["code"] == "body_too_large"


def test_a_slow_body_gets_408_and_is_dropped_while_others_are_served(server: tuple[int, list[int]]) -> None:
    port, _ = server
    results: list[Any] = []

    async def both() -> None:
        slow = asyncio.to_thread(trickle_body, port, "/echo", b'{"a": "' + b"x" * 64 + b'"}', 0.2)
        others = [asyncio.to_thread(ordinary, port) for _ in range(3)]
        results.extend(await asyncio.gather(slow, *others))

    asyncio.run(both())
    slow, *others = results
    assert slow.status == 408 and slow.body["error"]["code"] == "body_read_timeout"
    assert [r.json() for r in others] == [{"num_bytes": 9}] * 3


def test_headers_sent_byte_by_byte_are_cut_off(server: tuple[int, list[int]]) -> None:
    port, _ = server
    with connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(100):  # a slowloris: one header byte at a time, never the blank line
            if closed_by_server(sock, within=0.1):
                closed = True
                break
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed  # before 100 x 0.1 s: the 1 s header deadline, not the client, ended it
    assert ordinary(port).status_code == 200


def test_a_silent_connection_is_closed(server: tuple[int, list[int]]) -> None:
    port, _ = server
    with connect(port) as sock:
        assert closed_by_server(sock, within=20)


def test_headers_over_the_size_cap_are_refused_whole_or_in_pieces(server: tuple[int, list[int]],
                                                                   request: pytest.FixtureRequest) -> None:
    port, _ = server
    resp = httpx.post(f"http://127.0.0.1:{port}/echo", content=b"[]", headers={"X-Big": "a" * 8192}, timeout=30)
    assert resp.status_code == 431 and resp.json()["error"]["code"] == "headers_too_large"
    with connect(port) as sock:  # in pieces: refused once the unfinished head passes the cap
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        for _ in range(8):
            try:
                sock.sendall(b"X-Big: " + b"a" * 1024 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        reply = read_reply(sock)
        if request.node.callspec.params["server"] == "h11":
            assert reply.status == 400  # h11's own cap (max incomplete event size), answered by uvicorn
        else:
            assert reply.status == 431 and reply.body["error"]["code"] == "headers_too_large"
    assert ordinary(port).status_code == 200


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_requests_beyond_the_concurrency_limit_get_an_openai_503(http: str) -> None:
    limits = HttpLimits(limit_concurrency=2)
    with served(echo_app(limits, []), limits, http) as port, connect(port) as busy1, connect(port) as busy2:
        for busy in (busy1, busy2):  # two streams in progress fill the limit (idle connections do not:
            busy.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")  # tests/hostile/test_idle_sockets.py)
            assert busy.recv(12).startswith(b"HTTP/1.1 200")
        refused = ordinary(port)
        assert refused.status_code == 503 and refused.headers["connection"] == "close"
        assert refused.json() == {"error": {"message": refused.json()["error"]["message"],
                                            "type": "service_unavailable_error", "param": None, "code": "overloaded"}}
        assert str(limits.limit_concurrency) in refused.json()["error"]["message"]
    with served(echo_app(limits, []), limits) as port:
        assert ordinary(port).status_code == 200


def test_a_client_that_reads_nothing_is_dropped_and_its_stream_stopped() -> None:
    streams: list[str] = []
    with served(echo_app(LIMITS, [], streams), LIMITS) as port:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once: the server's writes pause
        sock.settimeout(30)
        sock.connect(("127.0.0.1", port))
        with sock:
            sock.sendall(f"GET /stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            deadline = time.monotonic() + 30  # the send deadline is 1 s; this only bounds a failing test
            while not streams and time.monotonic() < deadline:
                assert ordinary(port).status_code == 200  # everyone else is served meanwhile
            assert streams == ["stopped"]  # the response was cut off, its generator closed
        assert ordinary(port).status_code == 200


def test_until_disconnected_cancels_the_work_and_runs_its_cleanup() -> None:
    cleaned: list[str] = []

    async def work() -> str:
        try:
            await asyncio.Event().wait()  # a generation that would run to max_tokens
            return "done"
        finally:
            cleaned.append("closed upstream")

    async def scenario() -> tuple[str | None, str | None]:
        gone = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        asyncio.get_running_loop().call_soon(gone.set)
        left = await until_disconnected(receive, work())
        finished = await until_disconnected(asyncio.Event().wait, asyncio.sleep(0, "answer"))  # type: ignore[arg-type]
        return left, finished

    assert asyncio.run(scenario()) == (None, "answer")
    assert cleaned == ["closed upstream"]


def test_until_disconnected_lets_a_cancellation_from_elsewhere_through() -> None:
    """A server shutting down cancels the request's task: that is not a client leaving, and must not read as one."""
    cleaned: list[str] = []

    async def work() -> str:
        try:
            await asyncio.Event().wait()
            return "done"
        finally:
            cleaned.append("closed upstream")

    async def scenario() -> bool:
        never: asyncio.Event = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await never.wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(until_disconnected(receive, work()))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(scenario()) and cleaned == ["closed upstream"]
