"""--proxy-workers N: N proxy processes share one port, and none outlives the launcher (SIGTERM or SIGKILL)."""
from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from connector.control.security import CurveConfig
from epd_bench.proxy_servers import FakeDecoder
from epd_launcher.flags import parse_args
from proxy.config import ProxyConfig
from tests.ports import REUSE_PORT_ENV, PortHolds

CHAT = {"model": "demo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
FRESH = {"Connection": "close"}  # one connection per request: the kernel picks a process for each
INTERNAL_KEY = "proxy-workers-test-key"  # the proxy's /health names its pid only to a caller with it


@pytest.fixture(scope="module")
def decoder_url() -> Iterator[str]:
    """The fake decoder on its own event loop in a thread; the proxies run in processes of their own."""
    loop = asyncio.new_event_loop()
    decoder = FakeDecoder()
    loop.run_until_complete(decoder.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield decoder.url
    asyncio.run_coroutine_threadsafe(_close(decoder), loop).result(timeout=5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


async def _close(decoder: FakeDecoder) -> None:
    """Stop the connections still served (a proxy process may have died a moment ago), then the server."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await decoder.close()
    await asyncio.sleep(0)  # the closed transports' callbacks


def start_proxy(decoder_url: str, port: int, tmp: Path, num_procs: int = 2) -> tuple[subprocess.Popen[bytes], str]:
    """The launcher's proxy processes on `port`, which the caller holds (they bind beside the hold); their
    temporary files (the metrics directory) under `tmp`."""
    cmd = [sys.executable, "-m", "epd_launcher.cli", "--aggregated", "--decode-servers-urls", decoder_url,
           "--insecure", "--port", str(port), "--log-level", "warning", "--proxy-workers", str(num_procs)]
    env = {**os.environ, "EPD_INTERNAL_KEY": INTERNAL_KEY, "TMPDIR": str(tmp), **REUSE_PORT_ENV}
    return (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env),
            f"http://127.0.0.1:{port}")


def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def serving_pids(url: str, tries: int) -> set[int]:
    """The pids that answered `tries` /health calls, each on a fresh connection (none while nothing listens)."""
    pids = set()
    for _ in range(tries):
        try:
            pids.add(httpx.get(f"{url}/health", headers={**FRESH, "Authorization": f"Bearer {INTERNAL_KEY}"},
                               timeout=5.0).json()["pid"])
        except httpx.TransportError:
            pass
    return pids


def children(pid: int) -> set[int]:
    return {int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()}


def gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie left to whoever reaps orphans here."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def proxy(decoder_url: str, port_holds: PortHolds, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A proxy with 2 processes, once both serve; killed afterwards whatever the test did."""
    proc, url = start_proxy(decoder_url, port_holds.take(), tmp_path)
    try:
        until(lambda: len(serving_pids(url, 8)) == 2 or proc.poll() is not None, 30.0, "both processes serve")
        assert proc.poll() is None, f"the proxy exited with {proc.returncode}"
        yield proc, url
    finally:
        kids = children(proc.pid) if proc.poll() is None else set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        until(lambda: all(gone(pid) for pid in kids), 10.0, "the proxy's processes exit")


def test_requests_over_fresh_connections_all_succeed_and_reach_both_processes(
        proxy: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = proxy
    statuses = []
    for _ in range(40):
        resp = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=FRESH, timeout=10.0)
        statuses.append(resp.status_code)
        assert resp.text.rstrip().endswith("data: [DONE]")
    assert statuses == [200] * 40
    pids = serving_pids(url, 40)
    assert len(pids) == 2 and proc.pid in pids  # process 0 is the launcher itself


def test_sigterm_to_the_launcher_stops_every_proxy_process(proxy: tuple[subprocess.Popen[bytes], str],
                                                            tmp_path: Path) -> None:
    proc, url = proxy
    (child,) = serving_pids(url, 40) - {proc.pid}
    kids = children(proc.pid)
    assert child in kids  # beside it: multiprocessing's resource tracker, which exits once the launcher is gone
    (metrics_dir,) = tmp_path.glob("epd-proxy-metrics-*")  # the processes' metric files, while they serve
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert gone(child)  # stopped and joined before the launcher exits
    assert not metrics_dir.exists()  # removed on the way out
    until(lambda: all(gone(pid) for pid in kids), 5.0, "every child of the launcher exits")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2.0)


def test_a_killed_launcher_takes_its_proxy_processes_with_it(proxy: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = proxy
    kids = children(proc.pid)
    proc.kill()
    proc.wait()
    until(lambda: all(gone(pid) for pid in kids), 10.0, "the children of a SIGKILLed launcher exit")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2.0)


def test_a_proxy_process_that_dies_is_restarted_while_the_others_serve(
        proxy: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = proxy
    (child,) = serving_pids(url, 40) - {proc.pid}
    os.kill(child, signal.SIGKILL)
    until(lambda: gone(child), 10.0, "the killed proxy process exits")
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=FRESH, timeout=10.0).status_code == 200
    until(lambda: len(serving_pids(url, 8) - {proc.pid, child}) == 1, 30.0, "a new proxy process serves")
    assert proc.poll() is None


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The one sample `name` with `labels` in a /metrics answer."""
    (value,) = [s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == name and s.labels == (labels or {})]
    return value


def scrapes(url: str, tries: int) -> list[str]:
    """`tries` /metrics answers, each on a fresh connection: from whichever process the kernel picks."""
    return [httpx.get(f"{url}/metrics", headers=FRESH, timeout=5.0).text for _ in range(tries)]


def test_one_scrape_adds_up_every_proxy_process(proxy: tuple[subprocess.Popen[bytes], str]) -> None:
    """Requests on fresh connections land on both processes; a scrape of either answers for all of them."""
    proc, url = proxy
    for _ in range(12):
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=FRESH, timeout=10.0).status_code == 200
    ok = {"endpoint": "/v1/chat/completions", "status": "200"}
    for text in scrapes(url, 12):
        assert metric(text, "epd_proxy_requests_total", ok) == 12
        assert metric(text, "epd_proxy_e2e_request_latency_seconds_count") == 12
        assert metric(text, "epd_proxy_requests_in_flight") == 0  # live processes' gauges, summed
        assert metric(text, "epd_proxy_workers_healthy", {"role": "decoder"}) == 1  # the answering process's


def test_a_restarted_process_keeps_its_counts_in_the_sum(proxy: tuple[subprocess.Popen[bytes], str],
                                                         tmp_path: Path) -> None:
    proc, url = proxy
    for _ in range(10):
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=FRESH, timeout=10.0).status_code == 200
    (child,) = serving_pids(url, 40) - {proc.pid}
    (metrics_dir,) = tmp_path.glob("epd-proxy-metrics-*")
    assert (metrics_dir / f"gauge_livesum_{child}.db").exists()
    os.kill(child, signal.SIGKILL)
    until(lambda: len(serving_pids(url, 8) - {proc.pid, child}) == 1, 30.0, "a new proxy process serves")
    assert not (metrics_dir / f"gauge_livesum_{child}.db").exists()  # a dead process's in-flight gauge leaves the sum
    ok = {"endpoint": "/v1/chat/completions", "status": "200"}
    for text in scrapes(url, 8):
        assert metric(text, "epd_proxy_requests_total", ok) == 10  # the dead process's counts stay


def test_a_killed_launchers_metrics_directory_is_removed_by_the_next_start(
        proxy: tuple[subprocess.Popen[bytes], str], decoder_url: str, port_holds: PortHolds, tmp_path: Path) -> None:
    proc, url = proxy
    (stale,) = tmp_path.glob("epd-proxy-metrics-*")
    proc.kill()
    proc.wait()
    assert stale.is_dir() and stale.name.startswith(f"epd-proxy-metrics-{proc.pid}-")  # left behind by SIGKILL
    foreign = tmp_path / "epd-proxy-metrics-1-abc"  # a live pid's (init): never removed
    foreign.mkdir()
    again, url = start_proxy(decoder_url, port_holds.take(), tmp_path)
    try:
        until(lambda: len(list(tmp_path.glob(f"epd-proxy-metrics-{again.pid}-*"))) == 1 or again.poll() is not None,
              30.0, "the new launcher makes its directory")
        assert not stale.exists() and foreign.is_dir()
    finally:
        again.kill()
        again.wait()


@pytest.mark.parametrize("value", ["0", "-1", "65", "two"])
def test_out_of_range_proxy_workers_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--proxy-workers", value])
    assert exc.value.code == 2 and "--proxy-workers" in capsys.readouterr().err


def test_several_proxy_workers_with_dynamic_registration_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--proxy-workers", "2", "--dynamic-registration", "--internal-key", "k"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--proxy-workers" in err and "--dynamic-registration" in err
    assert parse_args(["--proxy-workers", "1", "--dynamic-registration"])[1].proxy_workers == 1


def test_the_proxy_config_reaches_a_spawned_process_whole() -> None:
    curve = CurveConfig(secret_key=b"s" * 40, public_key=b"p" * 40, server_key=b"k" * 40,
                        allowed_clients=frozenset({b"c" * 40}))
    cfg = ProxyConfig(encode_urls=("http://e:1",), decode_urls=("http://d:2",), curve=curve, api_key="a",
                      internal_key="i", allowed_media_domains=("h",))
    assert pickle.loads(pickle.dumps(cfg)) == cfg



def test_connections_accepted_on_a_shared_port_send_without_nagle() -> None:
    """asyncio turns Nagle off only on accepted sockets whose proto says TCP: with proto 0, every small SSE write
    after the first waited for the client's delayed ACK (46 ms median to the first streamed bytes, measured)."""
    from epd_common.server import reuseport_socket

    async def nodelay_of_an_accepted_connection() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=reuseport_socket("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0
