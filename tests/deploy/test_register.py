"""deploy/k8s/epd_register.py, the sidecar that keeps a worker registered with every proxy, against a fake proxy."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.deploy.manifests import K8S, register_module

SCRIPT = K8S / "epd_register.py"
KEY = "internal-test-key"


@dataclass
class FakeProxy:
    """Serves both sides: the worker's GET /health and the proxy's POST/DELETE /instances; records every call."""

    health: int = 200
    instances: dict[str, int] = field(default_factory=lambda: {"POST": 201, "DELETE": 200})
    calls: list[tuple[str, str, Any, str | None]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)
    url: str = ""

    def record(self, method: str, path: str, body: Any, auth: str | None) -> int:
        with self.changed:
            self.calls.append((method, path, body, auth))
            self.changed.notify_all()
        return self.health if path == "/health" else self.instances[method]

    def wait_for(self, predicate: Callable[[list[tuple[str, str, Any, str | None]]], bool], timeout: float = 15) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: predicate(self.calls), timeout), self.calls

    def of(self, method: str, path: str = "/instances") -> list[tuple[str, str, Any, str | None]]:
        with self.changed:
            return [c for c in self.calls if c[0] == method and c[1] == path]


@pytest.fixture
def fake() -> Iterator[FakeProxy]:
    state = FakeProxy()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status = state.record(self.command, self.path, body, self.headers.get("Authorization"))
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def register(fake: FakeProxy, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "EPD_INTERNAL_KEY": KEY, "EPD_PROXY_URL": fake.url}
    return subprocess.Popen([sys.executable, str(SCRIPT), *args, "--role", "encoder", "--url", fake.url,
                             "--interval", "0.05"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """Its exit code and output; one that does not exit is killed (and the test fails), its pipe closed."""
    with proc:
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"epd_register.py did not exit within 60 s of being asked to: {out}")
    return proc.returncode, out


def test_registers_while_healthy_keeps_registering_and_deregisters_on_sigterm(fake: FakeProxy) -> None:
    fake.instances["POST"] = 201
    proc = register(fake)
    try:
        fake.wait_for(lambda calls: sum(c[0] == "POST" for c in calls) >= 1)
        fake.instances["POST"] = 409  # already registered: still fine, and it keeps asking (a restarted proxy forgets)
        fake.wait_for(lambda calls: sum(c[0] == "POST" for c in calls) >= 3)
    finally:
        proc.send_signal(signal.SIGTERM)
        code, out = finish(proc)
    assert code == 0, out
    body = {"role": "encoder", "url": fake.url}
    assert {(c[2]["role"], c[2]["url"], c[3]) for c in fake.of("POST")} == {(*body.values(), f"Bearer {KEY}")}
    assert fake.calls[-1] == ("DELETE", "/instances", body, f"Bearer {KEY}")
    assert "WARNING" not in out  # 409 means "already have it", not a failure


def test_does_not_register_a_worker_that_is_not_healthy(fake: FakeProxy) -> None:
    fake.health = 503  # still loading its weights
    proc = register(fake)
    try:
        fake.wait_for(lambda calls: sum(c[1] == "/health" for c in calls) >= 3)
        assert fake.of("POST") == []
        fake.health = 200
        fake.wait_for(lambda calls: any(c[0] == "POST" for c in calls))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert finish(proc)[0] == 0


@pytest.mark.parametrize(("status", "code"), [(200, 0), (404, 0), (401, 1)])
def test_deregister_once_for_a_prestop_hook(fake: FakeProxy, status: int, code: int) -> None:
    fake.instances["DELETE"] = status  # 404: the proxy no longer has it, which is what we wanted
    assert finish(register(fake, "deregister"))[0] == code
    assert [c[0] for c in fake.calls] == ["DELETE"]


def test_a_proxy_name_reaches_every_address_it_resolves_to(monkeypatch: pytest.MonkeyPatch) -> None:
    module = register_module()
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 8000)),
               (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::8", 8000, 0, 0)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 8000))]
    monkeypatch.setattr(module.socket, "getaddrinfo", lambda host, port, **kw: answers)
    assert module.proxy_bases("http://epd-proxy-workers:8000") == ["http://10.0.0.7:8000", "http://[fd00::8]:8000"]
