"""Lifecycle against the real `disagg-epd-proxy` CLI (no model: fake workers whose /health we control):
a mistyped worker URL is a usage error at once; SIGTERM and Ctrl-C stop the proxy in every state; a port in
use fails before any worker starts; readiness tells when no decoder can take work; a worker of another model
is refused with a clear error; a poison request that workers answer with an error takes none of them out."""
from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.stack import start, stop
from tests.hostile.memory import peak_rss_bytes
from tests.loopback_http import LoopbackServer, QuietHandler
from tests.ports import PortHolds

pytestmark = pytest.mark.e2e  # starts proxy processes (no model is loaded)
EXIT_WITHIN_S = 20.0  # a stop signal ends the process within this (measured: under 1 s on an idle machine)
START_WITHIN_S = 120.0  # bounds the interpreter start (the CLI imports torch through connector/) on a loaded machine
PROXY_PEAK_RSS_BOUND = 256 << 20  # the proxy (no model) stays under this through every case below
KEY = "lifecycle-internal-key"
IDENTITY = {"family": "llava", "fingerprint": "0123456789abcdef", "hidden_size": 64}
OTHER = {"family": "qwen2_5_vl", "fingerprint": "fedcba9876543210", "hidden_size": 1536}


@dataclass
class FakeWorker:
    """A worker on loopback whose /health answers `health` (None: 503) and whose work endpoints answer
    `answer(path, body)` (a status and a JSON body)."""

    health: dict[str, Any] | None
    answer: Callable[[str, dict[str, Any]], tuple[int, dict[str, Any]]] = lambda path, body: (404, {})
    calls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._send(*((200, fake.health) if fake.health is not None else (503, {"error": {}})))

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                fake.calls.append(self.path)
                self._send(*fake.answer(self.path, body))

            def _send(self, status: int, body: dict[str, Any]) -> None:
                self.send_body(status, json.dumps(body).encode())

        self.http = LoopbackServer(Handler)

    @property
    def url(self) -> str:
        return self.http.url

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def workers() -> Iterator[list[FakeWorker]]:
    made: list[FakeWorker] = []
    yield made
    for w in made:
        w.close()


def fake(workers: list[FakeWorker], health: dict[str, Any] | None, **kw: Any) -> FakeWorker:
    workers.append(FakeWorker(health, **kw))
    return workers[-1]


def proxy(holds: PortHolds, tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """The proxy CLI on a port of `holds` (held for the test: it binds beside the hold)."""
    port = holds.take()
    log = tmp_path / f"proxy-{port}.log"
    return start("epd_launcher.cli", ["--port", str(port), "--health-interval", "0.2", *args], log, held=True), \
        f"http://127.0.0.1:{port}", log


def exit_code(proc: subprocess.Popen[bytes], within: float = EXIT_WITHIN_S) -> int:
    try:
        return proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"still running {within}s later") from None


def wait_for(what: str, check: Callable[[], bool], log: Path, deadline_s: float = START_WITHIN_S) -> None:
    end = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < end, f"{what} not within {deadline_s}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize("url", ["127.0.0.1:8001", "http://127.0.0.1:99999", "http://127.0.0.1:8001/v1"])
def test_a_mistyped_worker_url_is_a_usage_error_at_once(port_holds: PortHolds, tmp_path: Path, url: str) -> None:
    proc, _, log = proxy(port_holds, tmp_path, "--insecure", "--encode-servers-urls", url, "--decode-servers-urls",
                         "http://127.0.0.1:1")
    assert exit_code(proc, within=START_WITHIN_S) == 2  # no worker is ever contacted: at once
    assert url.rstrip("/") in log.read_text() and "error" in log.read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_a_proxy_still_waiting_for_unreachable_workers(port_holds: PortHolds, tmp_path: Path,
                                                                          sig: int) -> None:
    # held, never listening: refused for the whole test
    dead, unknown = f"http://127.0.0.1:{port_holds.take()}", "http://epd-no-such-host.invalid:8001"
    proc, _, log = proxy(port_holds, tmp_path, "--insecure", "--encode-servers-urls", dead, "--decode-servers-urls",
                         unknown)
    wait_for("both unreachable workers logged",
             lambda: f"waiting for encoder {dead}" in log.read_text() and f"waiting for decoder {unknown}" in
             log.read_text(), log)
    text = log.read_text()
    assert "cannot connect" in text and "DNS" in text  # each with why
    proc.send_signal(sig)
    exit_code(proc)
    assert "while waiting for workers: stopping" in log.read_text()


def test_a_stop_signal_ends_a_serving_proxy_with_a_generation_in_flight(port_holds: PortHolds, tmp_path: Path,
                                                                        workers: list[FakeWorker]) -> None:
    held = threading.Event()

    def hang(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        held.set()
        time.sleep(EXIT_WITHIN_S * 3)  # a decoder that never answers while the proxy drains
        return 500, {}

    dec = fake(workers, {"status": "ok", "model_identity": IDENTITY}, answer=hang)
    proc, base, log = proxy(port_holds, tmp_path, "--insecure", "--aggregated", "--decode-servers-urls", dec.url)
    wait_for("ready", lambda: status(f"{base}/ready") == 200, log)
    client = threading.Thread(target=lambda: _post_chat(base), daemon=True)
    client.start()
    assert held.wait(30)
    proc.send_signal(signal.SIGTERM)
    exit_code(proc, within=35)  # uvicorn drains for at most its 30 s grace, then stops


def _post_chat(base: str) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    except httpx.HTTPError:
        pass


def test_a_port_in_use_fails_before_any_worker_is_spawned(tmp_path: Path) -> None:
    with __import__("socket").socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        log = tmp_path / "launcher.log"
        proc = start("epd_launcher.cli", ["--model", "demo", "--port", str(port)], log)
        assert exit_code(proc, within=START_WITHIN_S) != 0
    text = log.read_text()
    assert f"cannot listen on 127.0.0.1:{port}" in text and "started encoder" not in text


def test_readiness_follows_the_decoders_and_a_worker_of_another_model_is_refused(
        port_holds: PortHolds, tmp_path: Path, workers: list[FakeWorker]) -> None:
    enc = fake(workers, {"status": "ok", "ec_address": "tcp://127.0.0.1:1", "ec_events_address": "tcp://127.0.0.1:2",
                         "model_identity": IDENTITY})
    dec = fake(workers, {"status": "ok", "model_identity": IDENTITY})
    stranger = fake(workers, {"status": "ok", "model_identity": OTHER})
    proc, base, log = proxy(port_holds, tmp_path, "--insecure", "--dynamic-registration", "--internal-key", KEY)
    try:
        wait_for("live", lambda: status(f"{base}/health") == 200, log)
        ready = httpx.get(f"{base}/ready", timeout=5)
        assert ready.status_code == 503 and "no healthy decoder" in ready.json()["error"]["message"]

        def register(role: str, url: str) -> httpx.Response:
            return httpx.post(f"{base}/instances", json={"role": role, "url": url}, timeout=10,
                              headers={"Authorization": f"Bearer {KEY}"})

        assert register("decoder", dec.url).status_code == 201
        assert status(f"{base}/ready") == 503  # no encoder yet
        assert register("encoder", enc.url).status_code == 201
        assert status(f"{base}/ready") == 200
        refused = register("decoder", stranger.url)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_mismatch"
        message = refused.json()["error"]["message"]
        assert all(s in message for s in (OTHER["fingerprint"], IDENTITY["fingerprint"], "qwen2_5_vl", "llava"))
        assert "model_mismatch" in log.read_text() and not stranger.calls
        dec.health = None  # the only decoder fails its probes: not ready, still live
        wait_for("not ready", lambda: status(f"{base}/ready") == 503, log)
        assert status(f"{base}/health") == 200
        dec.health = {"status": "ok", "model_identity": IDENTITY}  # back after one good probe
        wait_for("ready again", lambda: status(f"{base}/ready") == 200, log)
        assert peak_rss_bytes(proc.pid) < PROXY_PEAK_RSS_BOUND
    finally:
        stop(proc)


def test_a_poison_request_answered_with_errors_takes_no_worker_out(port_holds: PortHolds, tmp_path: Path,
                                                                  workers: list[FakeWorker]) -> None:
    def decode(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        poison = "poison" in json.dumps(body.get("messages"))
        if poison:
            return 500, {"error": {"message": "this request failed in the engine", "code": "engine_error"}}
        return 200, {}  # not NDJSON: the ordinary request only has to reach a decoder

    decs = [fake(workers, {"status": "ok", "model_identity": IDENTITY}, answer=decode) for _ in range(3)]
    proc, base, log = proxy(port_holds, tmp_path, "--insecure", "--aggregated", "--decode-servers-urls",
                            *(d.url for d in decs))
    try:
        wait_for("ready", lambda: status(f"{base}/ready") == 200, log)
        body = {"model": "demo", "messages": [{"role": "user", "content": "poison"}], "max_tokens": 2}
        for _ in range(4):  # the same hostile request, again and again
            resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
            assert resp.status_code == 500 and resp.json()["error"]["code"] == "engine_error"
        assert sum(len(d.calls) for d in decs) == 8  # each asked one decoder, then one more
        metrics = httpx.get(f"{base}/metrics", timeout=5).text  # (the worker list of /health needs an internal key)
        assert 'epd_proxy_workers_healthy{role="decoder"} 3.0' in metrics and status(f"{base}/ready") == 200
        assert "marked down" not in log.read_text()
    finally:
        stop(proc)
