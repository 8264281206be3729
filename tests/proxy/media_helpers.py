"""Shared pieces of the media tests: a config, a request, and the 400 a refused image gets."""
from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import httpx
import pytest
from PIL import Image

from epd_common.errors import APIError
from proxy.config import ProxyConfig
from proxy.prepare import prepare_chat
from proxy.protocol import ChatCompletionRequest
from tests.factories import make_image

PARAM = "messages.0.content.0.image_url.url"
Route = Callable[[BaseHTTPRequestHandler], None]


def config(**overrides: Any) -> ProxyConfig:
    values: dict[str, Any] = {"encode_urls": ("http://e",), "decode_urls": ("http://d",), "served_model_name": "demo",
                              "media_fetch_timeout": 0.5, **overrides}
    return ProxyConfig(**values)


def request(*urls: str) -> ChatCompletionRequest:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    msg = {"role": "user", "content": [*parts, {"type": "text", "text": "Describe the image."}]}
    return ChatCompletionRequest.model_validate({"model": "demo", "messages": [msg]})


def refused(cfg: ProxyConfig, *urls: str) -> APIError:
    with pytest.raises(APIError) as err:
        prepare_chat(request(*urls), cfg)
    assert err.value.status == 400
    return err.value


def fetched(cfg: ProxyConfig, url: str) -> bytes:
    chat = prepare_chat(request(url), cfg)
    assert len(chat.items) == 1
    return chat.items[0].data


def encode(img: Image.Image, fmt: str = "PNG", **params: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **params)
    return buf.getvalue()


def as_data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


PNG = encode(make_image(32, 24))


# --- a real loopback HTTP server ----------------------------------------------------------------------------

class CountingServer(HTTPServer):
    """Records every accepted connection and every request (path, Host header)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.accepted = 0
        self.seen: list[tuple[str, str]] = []
        self.routes: dict[str, Route] = {}

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def get_request(self) -> tuple[socket.socket, Any]:
        conn = super().get_request()
        self.accepted += 1
        return conn

    def paths(self) -> list[str]:
        return [path for path, _ in self.seen]


class Handler(BaseHTTPRequestHandler):
    server: CountingServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.seen.append((self.path, self.headers.get("Host", "")))
        route = self.server.routes.get(self.path) or self.server.routes.get(self.path.split("?", 1)[0])
        try:
            if route is None:
                self.send_error(404)
            else:
                route(self)
        except (BrokenPipeError, ConnectionResetError):  # the client hung up on purpose (cap, deadline)
            pass

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(body: bytes, content_type: str = "image/png", with_length: bool = True) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        if with_length:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    return route


def redirect(location: str, status: int = 302) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return route


def endless(pause: float = 0.0, chunk: bytes = b"\0" * 65536) -> Route:
    """200 image/png with no Content-Length and a body that never ends (until the client hangs up)."""
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "image/png")
        h.end_headers()
        h.wfile.write(PNG[:16])
        while True:
            h.wfile.write(chunk)
            h.wfile.flush()
            if pause:
                time.sleep(pause)  # a slow server, not a wait in the test
    return route


@contextmanager
def running(srv: CountingServer) -> Iterator[CountingServer]:
    srv.routes["/__sync__"] = serve(b"", "text/plain")
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()


def connections_made(srv: CountingServer) -> int:
    """Connections the server accepted before now (a sentinel request flushes the accept queue)."""
    with httpx.Client(trust_env=False) as client:
        assert client.get(srv.url("/__sync__")).status_code == 200
    assert srv.seen[-1][0] == "/__sync__"
    return srv.accepted - 1


class Trickle:
    """A route that declares a 1 MiB image (or `content_type`), sends its first bytes, then one byte per `pause` s
    until released (then it hangs up) or until the client hangs up; counts downloads in progress and those the
    client left."""

    def __init__(self, pause: float = 0.05, content_type: str = "image/png") -> None:
        self.pause, self.release, self.content_type = pause, threading.Event(), content_type
        self.active = self.abandoned = 0
        self._lock = threading.Lock()

    def __call__(self, h: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self.active += 1
        try:
            h.send_response(200)
            h.send_header("Content-Type", self.content_type)
            h.send_header("Content-Length", str(1 << 20))
            h.end_headers()
            h.wfile.write(PNG[:16])
            while not self.release.wait(self.pause):  # a slow host, not a wait in the test
                h.wfile.write(b"\0")
                h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            with self._lock:
                self.abandoned += 1
            raise
        finally:
            with self._lock:
                self.active -= 1


class ThreadingCountingServer(CountingServer):
    """A CountingServer that serves each connection on its own thread (several slow downloads at once)."""

    def process_request(self, request: Any, client_address: Any) -> None:
        threading.Thread(target=self._serve_one, args=(request, client_address), daemon=True).start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        finally:
            self.shutdown_request(request)


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll `predicate` until it holds or `timeout` passes (a deadline, not a guess at how long things take)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
