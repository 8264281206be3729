"""--proxy-workers N drains all its processes at once: process 0 signals the others as its own
drain begins, not after it, so a shutdown takes one --shutdown-timeout (not N) and no process keeps taking new
requests while another drains. Checked by the order of events, not by the clock."""
from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import pytest
from fastapi import FastAPI

from epd_common.admission import GracefulServer
from epd_common.server import HttpLimits, uvicorn_config
from epd_launcher import proxy_procs
from epd_launcher.group import RestartPolicy
from epd_launcher.proxy_procs import ProxyChildren
from proxy.config import ProxyConfig
from tests.hostile.http_client import connect, read_reply
from tests.ports import bound_socket, held_port

CFG = ProxyConfig(encode_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",), shutdown_timeout=30)


def test_the_drain_signals_the_others_while_its_own_requests_still_run() -> None:
    release, arrived, events = threading.Event(), threading.Event(), []
    app = FastAPI()

    @app.get("/hold")
    async def hold() -> dict[str, str]:
        arrived.set()
        await asyncio.to_thread(release.wait, 60)
        events.append("request finished")
        return {"ok": "yes"}

    drained = threading.Event()

    def on_drain() -> None:
        events.append("others signalled")
        drained.set()

    sock = bound_socket()
    server = GracefulServer(uvicorn_config(app, "127.0.0.1", 0, "warning", HttpLimits(shutdown_timeout=60)), on_drain)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:  # readiness, not a fixed sleep
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        with connect(sock.getsockname()[1]) as client:
            client.sendall(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
            assert arrived.wait(30)
            server.should_exit = True  # what SIGTERM does
            assert drained.wait(30)  # called while the request is held: before the drain waited for it
            release.set()
            assert read_reply(client).status == 200
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert events == ["others signalled", "request finished"]
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


class DrainingChild:
    """A proxy process that drains until the test says it is done: SIGTERM is recorded, exit comes later."""

    def __init__(self, pid: int, log: list[str]) -> None:
        self.pid, self.exitcode, self.log = pid, None, log

    def terminate(self) -> None:
        self.log.append(f"SIGTERM {self.pid}")

    def join(self, timeout: float | None = None) -> None:
        self.log.append(f"joined {self.pid}")
        self.exitcode = 0

    def kill(self) -> None:
        raise AssertionError("a draining child was killed")


def test_terminate_signals_every_child_before_any_has_finished_draining() -> None:
    log: list[str] = []
    children = ProxyChildren(CFG, 3, RestartPolicy(), "unused")
    children.procs = [DrainingChild(pid, log) for pid in (11, 12, 13)]  # type: ignore[misc]
    children.terminate()
    assert log == ["SIGTERM 11", "SIGTERM 12", "SIGTERM 13"]  # all at once; none waited for
    children.stop()  # then each is waited for, within the one grace
    assert [e for e in log if e.startswith("joined")] == ["joined 11", "joined 12", "joined 13"]
    assert log.index("SIGTERM 13") < log.index("joined 11")


def test_the_first_process_hands_the_others_terminate_to_its_drain(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Any) -> None:
    seen: dict[str, Any] = {}

    def fake_serve(*args: Any, on_drain: Any = None, **kwargs: Any) -> None:
        seen["on_drain"] = on_drain
        kwargs["sock"].close()

    monkeypatch.setattr(proxy_procs, "serve", fake_serve)
    monkeypatch.setattr(proxy_procs, "create_app", lambda *a, **k: None)
    monkeypatch.setattr(proxy_procs, "use_multiprocess", lambda d: None)
    monkeypatch.setattr(ProxyChildren, "start", lambda self: None)
    monkeypatch.setattr(proxy_procs.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # serve_proxies sets SIGTERM's handler: not pytest's
    with held_port() as port:  # serve_proxies binds it beside the hold, as under EPD_REUSE_PORT
        cfg = ProxyConfig(encode_urls=CFG.encode_urls, decode_urls=CFG.decode_urls, port=port)
        proxy_procs.serve_proxies(cfg, 2)
    assert seen["on_drain"].__func__ is ProxyChildren.terminate
