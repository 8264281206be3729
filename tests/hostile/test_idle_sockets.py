"""Sockets that send nothing: with --limit-concurrency 8, eight idle TCP connections made every
request and /health a 503 until the header deadline closed them, and the attacker reconnected. Now the limit counts
requests whose head has arrived, the probes are never refused for load, and one address's connections that have
sent no complete head are bounded (--max-pending-connections-per-ip, by default the limit): past it its oldest is
closed."""
from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from fastapi import FastAPI

from epd_common.admission import PendingConnections
from epd_common.server import HttpLimits
from tests.hostile.http_client import closed_by_server, connect, read_reply, served
from tests.hostile.memory import rss_bytes
from tests.hostile.stack import HostileStack, hostile_stack, stream_chat, victim_body, victims_throughout

LIMIT = 8
IDLE_RSS_BOUND = 32 << 20  # what 200 idle connections may add to a server that keeps at most LIMIT of them


def app(release: threading.Event, arrived: threading.Semaphore) -> FastAPI:
    api = FastAPI()

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @api.get("/echo")
    async def echo() -> dict[str, str]:
        return {"ok": "yes"}

    @api.get("/hold")
    async def hold() -> dict[str, str]:  # a request in progress until the test releases it
        arrived.release()
        await asyncio.to_thread(release.wait, 60)
        return {"held": "done"}

    return api


@contextmanager
def server(limits: HttpLimits, http: str) -> Iterator[tuple[int, threading.Event, threading.Semaphore]]:
    release, arrived = threading.Event(), threading.Semaphore(0)
    try:
        with served(app(release, arrived), limits, http) as port:
            yield port, release, arrived
    finally:
        release.set()


def get(port: int, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=30)


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_idle_sockets_hold_no_request_slot(http: str) -> None:
    """32 connections that send nothing, under a limit of 8 requests: every request and probe is answered (before:
    all 503 `overloaded`)."""
    limits = HttpLimits(limit_concurrency=LIMIT, max_pending_connections_per_ip=64, header_timeout=60)
    with server(limits, http) as (port, _, _), ExitStack() as idle:
        for _ in range(4 * LIMIT):
            idle.enter_context(connect(port))
        for path in ("/echo", "/health", "/ready", "/echo"):
            assert get(port, path).status_code == 200, path


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_requests_in_progress_fill_the_limit_but_never_the_probes(http: str) -> None:
    limits = HttpLimits(limit_concurrency=2)
    with server(limits, http) as (port, release, arrived), ExitStack() as held:
        socks = [held.enter_context(connect(port)) for _ in range(2)]
        for sock in socks:
            sock.sendall(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in socks:  # both requests are in progress
            assert arrived.acquire(timeout=30)
        refused = get(port, "/echo")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
        assert refused.headers["connection"] == "close"
        assert "2 requests in progress" in refused.json()["error"]["message"]
        assert get(port, "/health").status_code == 200 and get(port, "/ready").status_code == 200
        release.set()
        assert [read_reply(s).status for s in socks] == [200, 200]
    # the slots came back: the limit counts requests in progress, not requests ever made
    with server(limits, http) as (port, _, _):
        assert [get(port, "/echo").status_code for _ in range(4)] == [200] * 4


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_one_address_keeps_at_most_the_bound_of_silent_connections_the_oldest_closed(http: str) -> None:
    limits = HttpLimits(limit_concurrency=LIMIT, header_timeout=60)  # the bound: the limit, by default
    assert limits.pending_per_ip == LIMIT
    with server(limits, http) as (port, _, _), ExitStack() as idle:
        rss_before = rss_bytes()
        socks = [idle.enter_context(connect(port)) for _ in range(200)]
        # every connection past the bound closes the oldest silent one: all but the last LIMIT are closed, each
        # long before the 60 s header deadline could have done it
        assert all(closed_by_server(s, within=30) for s in socks[:-LIMIT])
        assert rss_bytes() - rss_before < IDLE_RSS_BOUND
        for path in ("/echo", "/health"):  # a new client's connection sends its head at once: it is served
            assert get(port, path).status_code == 200
        # a connection that has sent a request head is no longer pending: silent ones do not close it
        with connect(port) as talker:
            talker.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_reply_keepalive(talker) == 200
            more = [idle.enter_context(connect(port)) for _ in range(2 * LIMIT)]
            assert all(closed_by_server(s, within=30) for s in more[:LIMIT])
            talker.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_reply_keepalive(talker) == 200


def read_reply_keepalive(sock: socket.socket) -> int:
    """The status of one response on a kept-alive connection (read up to its body's end, connection left open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "closed by the server"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head[9:12])


def test_pending_connections_hand_back_the_oldest_past_the_bound() -> None:
    pending = PendingConnections()
    assert [pending.add("a", i, 2) for i in range(4)] == [None, None, 0, 1]  # per address, oldest first
    assert pending.add("b", 9, 2) is None and pending.count("a") == 2  # another address has its own bound
    pending.remove("a", 3)
    pending.remove("a", 3)  # idempotent
    assert pending.add("a", 4, 2) is None and pending.count("a") == 2
    pending.remove("a", 2)
    pending.remove("a", 4)
    assert "a" not in pending.by_source  # an address with none left is forgotten (memory stays bounded)


@pytest.fixture(scope="module")
def small_limit_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileStack]:
    with hostile_stack(tmp_path_factory.mktemp("idle"), proxy_args=("--limit-concurrency", str(LIMIT))) as s:
        yield s


def test_a_reconnecting_idle_socket_flood_leaves_other_users_and_health_undisturbed(
        small_limit_stack: HostileStack) -> None:
    """The issue's attack on a real proxy (--limit-concurrency 8): an attacker at another address (127.0.0.2) keeps
    reopening silent connections, 200 of them, while two users stream; their answers are what they were alone,
    /health and a chat answer, and the proxy's memory stays bounded. (From the users' own address the per-address
    bound may close a user's connection that has not sent its head yet, as the attacker's: one address is one
    client to it; on a busy machine that happened to a victim's stream.)"""
    stack = small_limit_stack
    port = int(stack.base_url.rsplit(":", 1)[1])
    rss_before = stack.rss()["proxy"]
    with victims_throughout(stack.base_url, n=2) as run, ExitStack() as idle:
        socks = [idle.enter_context(connect(port, "127.0.0.2")) for _ in range(200)]
        health = [httpx.get(f"{stack.base_url}/health", timeout=30).status_code for _ in range(5)]
        chat = stream_chat(stack.base_url, victim_body(7, max_tokens=8))
        # the attacker's silent connections past the bound were closed, oldest first (the header deadline, 10 s,
        # would have closed them only after the streams)
        assert all(closed_by_server(sock, within=30) for sock in socks[:-LIMIT])
        rss_during = stack.rss()["proxy"]
    run.assert_undisturbed()
    assert health == [200] * 5
    assert chat.status == 200 and chat.done, chat
    assert rss_during - rss_before < IDLE_RSS_BOUND
    assert not stack.dead()
