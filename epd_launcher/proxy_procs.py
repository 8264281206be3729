"""--proxy-workers N: N proxy processes on one port, so that the proxy's capacity grows with cores.

Each process binds its own SO_REUSEPORT socket (epd_common.server.reuseport_socket) and the kernel spreads new
connections over them. Process 0 is the caller; the others are started with `spawn` (never fork: the launcher has
threads) and each builds its own app from the same ProxyConfig: its own fleet, health probes and cache index (fed by
the encoders' ZeroMQ events). Nothing is shared between them, so nothing is locked, but their metrics: each
process keeps its values in files of one directory (prometheus_client's multiprocess mode, made here and removed
on the way out), and a scrape of /metrics on any of them answers the sum over all.
Children never outlive process 0: it stops them on its way out, and each gets SIGTERM if process 0 dies (even by
SIGKILL). A child that dies unexpectedly is logged and restarted under the launcher's RestartPolicy.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

from prometheus_client.multiprocess import mark_process_dead

from epd_common.logs import setup_logging
from epd_common.metrics import use_multiprocess
from epd_common.port_listeners import refuse_if_listened
from epd_common.server import HttpLimits, reuseport_socket, serve
from epd_launcher.flag_types import MAX_PROXY_WORKERS
from epd_launcher.group import STOP_MARGIN_S, RestartPolicy
from proxy.app import create_app
from proxy.config import ProxyConfig

logger = logging.getLogger("epd.proxy")

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5  # how often process 0 looks at its children
METRICS_PREFIX = "epd-proxy-metrics-"  # + the launcher's pid: its processes' metric files, under $TMPDIR


def serve_proxies(cfg: ProxyConfig, num_procs: int, policy: RestartPolicy | None = None,
                  on_ready: Callable[[], None] | None = None) -> None:
    """Serve `cfg` here and in num_procs - 1 spawned processes on one port, until SIGINT/SIGTERM; then stop all."""
    assert 1 <= num_procs <= MAX_PROXY_WORKERS, f"num_procs must be in 1..{MAX_PROXY_WORKERS}"
    sock = reuseport_socket(cfg.host, cfg.port)  # before the children: a port error stops us here
    try:  # NOTE: at bind, not listen: a child may listen first; none has started yet
        refuse_if_listened(*sock.getsockname()[:2])
    except SystemExit:
        sock.close()
        raise
    # NOTE: uvicorn re-raises SIGTERM after its graceful shutdown; SystemExit lets the `finally` stop the children
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    remove_stale_metrics(Path(tempfile.gettempdir()))
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")
    children = ProxyChildren(cfg, num_procs - 1, policy or RestartPolicy(), metrics_dir)
    try:
        use_multiprocess(metrics_dir)  # NOTE: the workers were spawned before: their environment is without it
        children.start()
        # NOTE: the others are signalled as this one starts to drain, not after: all drain at once, within one
        # --shutdown-timeout, and none takes new requests meanwhile (they were signalled in turn before)
        serve(create_app(cfg, on_ready, metrics_dir), cfg.host, cfg.port, cfg.log_level, HttpLimits.of(cfg),
              sock=sock, on_drain=children.terminate)
    finally:
        children.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def remove_stale_metrics(tmp: Path) -> None:
    """Remove the metrics directories of launchers that died without removing theirs (SIGKILL): those whose pid
    (in the name) no longer runs. One whose pid runs again (reused) is left: never one that may be live."""
    for path in tmp.glob(f"{METRICS_PREFIX}*-*"):
        pid = path.name.removeprefix(METRICS_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s: its launcher (pid %s) is gone", path, pid)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class ProxyChildren:
    """Processes 1..N-1: started, watched (an exit is logged and restarted with backoff), stopped; stop() is
    idempotent."""

    def __init__(self, cfg: ProxyConfig, num: int, policy: RestartPolicy, metrics_dir: str) -> None:
        self.cfg, self.num, self.policy, self.metrics_dir = cfg, num, policy, metrics_dir
        self.procs: list[BaseProcess] = []
        self._ctx = multiprocessing.get_context("spawn")
        self._restarts: list[deque[float]] = [deque() for _ in range(num)]  # per child: monotonic restart times
        self._given_up: set[int] = set()  # children left down (past --max-restarts)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.procs = [self._spawn(i) for i in range(self.num)]
        if self.num:  # NOTE: restarts are spawned from this thread; PDEATHSIG follows it (it lives until stop())
            self._thread = threading.Thread(target=self._watch, name="epd-proxy-procs", daemon=True)
            self._thread.start()

    def _spawn(self, i: int) -> BaseProcess:
        proc = self._ctx.Process(target=child_main, args=(self.cfg, i + 1, os.getpid(), self.metrics_dir),
                                 name=f"epd-proxy-{i + 1}", daemon=True)
        proc.start()
        logger.info("started proxy process %d: pid=%s", i + 1, proc.pid)
        return proc

    def _watch(self) -> None:
        while not self._stopping.wait(_POLL_S):
            for i, proc in enumerate(self.procs):
                if proc.exitcode is not None and i not in self._given_up and not self._stopping.is_set():
                    self._on_exit(i, proc.exitcode)

    def _on_exit(self, i: int, code: int) -> None:
        """An unexpected exit: restart after a doubling backoff, or leave it down past --max-restarts. Its counters
        and histograms stay in the sum; its in-flight gauge leaves it."""
        mark_process_dead(self.procs[i].pid, self.metrics_dir)
        restarts = self._restarts[i]
        delay = self.policy.next_delay(restarts, time.monotonic())
        if delay is None:
            logger.error("proxy process %d exited with code %s; not restarting it: %d restarts in the last %.0f s; "
                         "the other proxy processes serve the port", i + 1, code, len(restarts), self.policy.window)
            self._given_up.add(i)
            return
        logger.error("proxy process %d exited with code %s; restarting it in %.1f s", i + 1, code, delay)
        if self._stopping.wait(delay):
            return
        restarts.append(time.monotonic())
        self.procs[i] = self._spawn(i)

    def terminate(self) -> None:
        """SIGTERM to every child at once (each drains: epd_common.admission), none restarted; returns at once."""
        self._stopping.set()
        for proc in self.procs:
            if proc.pid is not None and proc.exitcode is None:
                proc.terminate()

    def stop(self) -> None:
        """SIGTERM to each child (each finishes its in-flight requests), SIGKILL past the grace; all joined."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        live = [p for p in self.procs if p.pid is not None and p.exitcode is None]
        for proc in live:
            proc.terminate()  # NOTE: again after terminate(): a child the watcher spawned meanwhile; a 2nd is harmless
        grace = self.cfg.shutdown_timeout + STOP_MARGIN_S  # each child drains for up to --shutdown-timeout
        deadline = time.monotonic() + grace
        for proc in live:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.exitcode is None:
                logger.error("proxy process pid=%s did not stop within %.0f s: killed", proc.pid, grace)
                proc.kill()
                proc.join()


def child_main(cfg: ProxyConfig, index: int, parent_pid: int, metrics_dir: str) -> None:
    """A spawned proxy process: die with process 0, then serve `cfg` on a socket of its own on the shared port."""
    _die_with(parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # uvicorn re-raises it after its shutdown: exit 0
    setup_logging(f"proxy-{index}", cfg.log_level)
    use_multiprocess(metrics_dir)
    sock = reuseport_socket(cfg.host, cfg.port)
    serve(create_app(cfg, metrics_dir=metrics_dir), cfg.host, cfg.port, cfg.log_level, HttpLimits.of(cfg), sock=sock)


def _die_with(parent_pid: int) -> None:
    """SIGTERM when the parent dies, even by SIGKILL (Linux prctl); exit now if it is already gone (the race
    between its death and the prctl)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        logger.warning("prctl(PR_SET_PDEATHSIG) is not available: this process may outlive its parent")
    if os.getppid() != parent_pid:
        sys.exit(0)
