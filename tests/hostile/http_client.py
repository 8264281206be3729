"""Raw-socket clients that behave badly on purpose (chunked floods, slow bodies, slow headers), and a server."""
from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from epd_common.server import HttpLimits, uvicorn_config
from tests.ports import serve_in_thread


@dataclass
class Reply:
    status: int
    body: dict[str, Any] | None
    headers: dict[str, str]


@contextmanager
def served(app: Any, limits: HttpLimits, http: str = "auto") -> Iterator[int]:
    """`app` behind uvicorn with `limits` (as `serve` runs it; `http`: its HTTP protocol), in a thread, on a socket
    bound before it starts (tests/ports.py); yields the port."""
    with serve_in_thread(uvicorn_config(app, "127.0.0.1", 0, "warning", limits, http)) as port:
        yield port


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A TCP connection to the loopback server from `source` (another loopback address is another client)."""
    return socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))


def head(path: str, port: int, extra: str = "", chunked: bool = True, length: int | None = None) -> bytes:
    framing = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {length}\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"{framing}{extra}\r\n").encode()


def flood_chunked(port: int, path: str, total: int, chunk: int = 1 << 20, extra: str = "") -> tuple[Reply, int]:
    """POST up to `total` bytes as 1 MiB chunks, stopping when the server answers or hangs up; the reply and
    how many body bytes went out."""
    payload = f"{chunk:x}\r\n".encode() + b"[" * chunk + b"\r\n"
    sent = 0
    with connect(port) as sock:
        sock.sendall(head(path, port, extra))
        while sent < total and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(payload)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += chunk
        if sent >= total:
            try:
                sock.sendall(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
        return read_reply(sock), sent


def trickle_body(port: int, path: str, body: bytes, pause: float, extra: str = "") -> Reply:
    """A Content-Length body sent one byte per `pause` seconds (the slow client under test), until the server
    answers or hangs up."""
    with connect(port) as sock:
        sock.sendall(head(path, port, extra, chunked=False, length=len(body)))
        for i in range(len(body)):
            if select.select([sock], [], [], pause)[0]:  # paces the client; wakes early when the server answers
                break
            try:
                sock.sendall(body[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
        return read_reply(sock)


def read_reply(sock: socket.socket) -> Reply:
    """Everything the server sends until it closes (or 30 s of silence), parsed as one HTTP/1.1 response."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            if _complete(data):
                break
    except (ConnectionResetError, TimeoutError):
        pass
    return parse(data)


def _complete(data: bytes) -> bool:
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return False
    headers = parse_headers(data[:head_end])
    return "content-length" in headers and len(data) - head_end - 4 >= int(headers["content-length"])


def parse_headers(raw: bytes) -> dict[str, str]:
    lines = raw.decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}


def parse(data: bytes) -> Reply:
    assert data.startswith(b"HTTP/1.1 "), f"no HTTP response: {data[:200]!r}"
    head_end = data.index(b"\r\n\r\n")
    body = data[head_end + 4:]
    headers = parse_headers(data[:head_end])
    parsed = json.loads(body) if headers.get("content-type") == "application/json" and body else None
    return Reply(int(data[9:12]), parsed, headers)


def closed_by_server(sock: socket.socket, within: float = 30.0) -> bool:
    """Whether the server closes the connection (EOF or reset) before `within` seconds pass."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
