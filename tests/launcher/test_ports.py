"""The launcher's worker ports cannot be taken by another program between the pick and the worker's bind, nor
while a worker is down between restarts (once seen as "encoder ... exited with code 3 during startup" after
[Errno 98], a port chosen free taken before the worker bound it).

The workers here are tests/launcher/fake_worker.py (no model): each waits for the test's signal, then binds its port
the way encoders and decoders do (epd_common.cli.run_worker)."""
from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from epd_common.port_listeners import listeners
from epd_launcher import spawn as spawn_module
from epd_launcher.flags import parse_args
from epd_launcher.group import Worker, WorkerGroup, free_port
from tests.ports import REUSE_PORT_ENV, PortHolds


def _plain(port: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()


def _reuse_addr(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def _asyncio_server(port: int) -> None:
    """As uvicorn binds (asyncio: SO_REUSEADDR, then listen)."""
    async def bind() -> None:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", port)
        server.close()

    asyncio.run(bind())


def _others_cannot_take(port: int) -> None:
    """Another program binding the port (the race that failed the start) gets EADDRINUSE, whichever way it binds."""
    for take in (_plain, _reuse_addr, _asyncio_server):
        with pytest.raises(OSError) as exc:
            take(port)
        assert exc.value.errno == errno.EADDRINUSE, take.__name__


def _port(w: Worker) -> int:
    return int(w.url.rsplit(":", 1)[1])


def _served_by(w: Worker) -> int:
    return int(httpx.get(f"{w.url}/health", timeout=10).json()["pid"])


def test_a_picked_port_stays_the_workers_until_it_binds(group: WorkerGroup, tmp_path: Path) -> None:
    go = tmp_path / "go"
    w = group.spawn("decoder", "none", "127.0.0.1", 1, ["--go", str(go)])
    _others_cannot_take(_port(w))  # the worker has not bound yet: before the fix, each of these took the port
    with pytest.raises(httpx.ConnectError):  # held, not listening: a client is refused, never left hanging
        httpx.get(f"{w.url}/health", timeout=10)
    go.touch()
    group.wait_healthy(timeout=120)
    assert _served_by(w) == w.proc.pid


def test_a_restarted_worker_gets_its_port_back_however_long_it_was_down(group: WorkerGroup, tmp_path: Path) -> None:
    go = tmp_path / "go"
    go.touch()
    w = group.spawn("decoder", "none", "127.0.0.1", 1, ["--go", str(go)])
    group.wait_healthy(timeout=120)
    first = w.proc.pid
    os.kill(first, signal.SIGKILL)
    w.proc.wait()
    _others_cannot_take(_port(w))  # the worker is down: its port is still not free for others
    with pytest.raises(httpx.ConnectError):  # and the proxy sees it down at once (failover)
        httpx.get(f"{w.url}/health", timeout=10)
    group.check(w, time.monotonic())  # notices the exit
    assert w.restart_at is not None
    group.check(w, w.restart_at)  # restarts it: same command, same port
    group.wait_healthy(timeout=120)
    assert _served_by(w) == w.proc.pid != first


def test_stop_gives_the_ports_back(group: WorkerGroup, tmp_path: Path) -> None:
    go = tmp_path / "go"
    go.touch()
    port = _port(group.spawn("decoder", "none", "127.0.0.1", 1, ["--go", str(go)]))
    group.wait_healthy(timeout=120)
    group.stop()
    _plain(port)  # free again for anyone


def test_worker_base_port_gives_each_worker_its_own_port_and_a_taken_one_is_a_clear_error(
        group: WorkerGroup, tmp_path: Path) -> None:
    go = tmp_path / "go"
    go.touch()
    for _ in range(3):  # another program may take the port picked free before the spawn holds it: pick again
        wanted = free_port()
        try:
            w = group.spawn("decoder", "none", "127.0.0.1", 1, ["--go", str(go)], port=wanted)
            break
        except SystemExit:
            continue
    else:
        pytest.fail("no free port could be held three times in a row")
    assert _port(w) == wanted
    _others_cannot_take(wanted)
    group.wait_healthy(timeout=120)
    assert _served_by(w) == w.proc.pid
    with socket.socket() as taken:  # held by another program (no SO_REUSEPORT): the launcher says so and stops
        taken.bind(("127.0.0.1", 0))
        with pytest.raises(SystemExit, match=rf"port {taken.getsockname()[1]} .*--worker-base-port"):
            group.spawn("decoder", "none", "127.0.0.1", 1, ["--go", str(go)], port=taken.getsockname()[1])


def test_the_ports_run_encoders_then_decoders_then_prefill_workers_from_the_base() -> None:
    assert [spawn_module._port(argparse.Namespace(worker_base_port=9100), i) for i in range(4)] == [9100, 9101, 9102,
                                                                                                  9103]
    assert spawn_module._port(argparse.Namespace(worker_base_port=0), 3) == 0  # fresh ports
    _, args = parse_args(["--model", "demo", "--worker-base-port", "9100"])
    assert args.worker_base_port == 9100
    for bad in ("80", "65500", "x"):
        with pytest.raises(SystemExit):
            parse_args(["--model", "demo", "--worker-base-port", bad])
    with pytest.raises(SystemExit):  # a launcher-mode flag: attach mode spawns nothing
        parse_args(["--worker-base-port", "9100", "--encode-servers-urls", "http://e:1", "--decode-servers-urls",
                    "http://d:2"])


def _reuseport_listener() -> socket.socket:
    """A server bound as every EPD worker binds (SO_REUSEADDR + SO_REUSEPORT), listening on a fresh port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_port_an_epd_worker_listens_on_cannot_be_reserved(group: WorkerGroup, tmp_path: Path) -> None:
    """The reservation once was SO_REUSEPORT, so a second stack's workers joined the first's on a shared
    --worker-base-port; now a listener with SO_REUSEPORT stops the start like any other program."""
    with _reuseport_listener() as stranger:
        port = stranger.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"cannot reserve port {port} .*--worker-base-port"):
            group.spawn("decoder", "none", "127.0.0.1", 1, ["--go", str(tmp_path / "go")], port=port)
    assert not group.workers  # nothing was started


def test_a_second_stack_on_the_same_worker_port_stops_and_the_first_keeps_serving(
        group: WorkerGroup, tmp_path: Path, port_holds: PortHolds) -> None:
    """The first stack: a fake worker spawned by a WorkerGroup on a port; the second: the launcher itself, asked
    for the same --worker-base-port. It exits with the one-line error before starting any worker, and every
    connection to the port still reaches the first stack's worker."""
    go = tmp_path / "go"
    go.touch()
    w = group.spawn("decoder", "none", "127.0.0.1", 1, ["--go", str(go)])
    group.wait_healthy(timeout=120)
    proxy_port = port_holds.take()  # the second launcher's own --port, held for it (it binds beside the hold)
    second = subprocess.run(
        [sys.executable, "-m", "epd_launcher.cli", "--model", "demo", "--port", str(proxy_port),
         "--worker-base-port", str(_port(w)), "--log-level", "warning"],
        env={**os.environ, **REUSE_PORT_ENV}, capture_output=True, text=True, timeout=300)
    assert second.returncode != 0
    assert f"cannot reserve port {_port(w)} on 127.0.0.1 for an encoder" in second.stderr, second.stderr
    assert "Traceback" not in second.stderr
    assert {_served_by_fresh(w) for _ in range(20)} == {w.proc.pid}  # the first stack's worker, alone


def _served_by_fresh(w: Worker) -> int:
    return int(httpx.get(f"{w.url}/health", headers={"Connection": "close"}, timeout=10).json()["pid"])


def test_a_worker_never_listens_where_another_process_listens(port_holds: PortHolds, tmp_path: Path) -> None:
    """The worker's side: started beside its hold (EPD_REUSE_PORT=1), it could join a listener of the same user
    that bound the port with SO_REUSEPORT after the hold; it looks before it listens and exits naming the port."""
    port = port_holds.take()
    go = tmp_path / "go"
    go.touch()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as stranger:
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        stranger.bind(("127.0.0.1", port))  # beside the hold: same user, SO_REUSEPORT
        stranger.listen()
        worker = subprocess.run([sys.executable, "-m", "tests.launcher.fake_worker", "--model", "none", "--host",
                                 "127.0.0.1", "--port", str(port), "--go", str(go)],
                                env={**os.environ, **REUSE_PORT_ENV}, capture_output=True, text=True, timeout=120)
        assert worker.returncode != 0
        assert f"another process already listens on 127.0.0.1:{port}" in worker.stderr, worker.stderr
        assert listeners("127.0.0.1", port) == 1  # the stranger's, alone
