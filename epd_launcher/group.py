"""Launcher mode: spawn N encoders and M decoders on this machine, wait for health, restart any that exits
(with backoff, capped per window), stop them all on exit."""
from __future__ import annotations

import collections
import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import zmq

from connector.control.security import ENV_ALLOWED_CLIENTS, ENV_SECRET_KEY, ENV_SERVER_KEY, CurveConfig
from epd_common.server import ENV_REUSE_PORT

logger = logging.getLogger("epd.launcher")
WORKER_MODULES = {"encoder": "encoder_service.cli", "decoder": "decoder_service.cli", "proxy": "epd_launcher.cli"}
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2  # how often the supervisor looks at its children
STOP_MARGIN_S = 5.0  # past a server's --shutdown-timeout: its lifespan shutdown (engine, sockets) before SIGKILL
_PROGRESS_S = 10.0  # how often wait_healthy names the workers still loading


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now; another process may take it before it is bound again (reserve_port holds one)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def reserve_port(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A fresh port (or `port`: OSError if another socket has it) held for a child until the socket is closed: bound
    alone, never listening, then marked SO_REUSEPORT for the child.

    The bind itself is exclusive: SO_REUSEADDR only (a connection of an earlier run in TIME_WAIT is no conflict), so
    it fails on a port where anything listens, SO_REUSEPORT or not (another EPD stack's worker), or
    that another socket holds bound (another launcher's reservation). Then SO_REUSEADDR is cleared and SO_REUSEPORT
    set: nobody else can bind the port meanwhile (bind(0) never hands it out; a stranger's bind without SO_REUSEPORT
    is EADDRINUSE, with SO_REUSEADDR too: the kernel checks the flags each socket has now), connections to it are
    refused while no child listens (failover sees a dead worker at once), and a child started with EPD_REUSE_PORT=1
    binds it with SO_REUSEPORT beside the reservation (epd_common.server): at its first start and at every restart,
    however long the worker was down; that child still refuses to listen where another process listens
    (epd_common.port_listeners)."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError:
        s.close()
        raise
    return s


def _die_with_parent() -> None:
    """Child side: get SIGTERM if the launcher dies, even by SIGKILL (Linux), so nothing is orphaned.
    NOTE: the signal follows the *thread* that spawned the child: spawn only from long-lived threads."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass(frozen=True)
class Secrets:
    """Per-start credentials: the internal HTTP key and two CURVE pairs (the encoders' server pair, and a
    client pair for decoders and the proxy; the encoders admit only that client key). They reach workers
    through their environment, never argv, and are never logged."""

    internal_key: str = field(repr=False)
    server: tuple[bytes, bytes] = field(repr=False)  # (public, secret) of the encoders
    client: tuple[bytes, bytes] = field(repr=False)  # (public, secret) of decoders and the proxy

    @classmethod
    def generate(cls, internal_key: str | None = None) -> Secrets:
        return cls(internal_key or secrets.token_urlsafe(32), zmq.curve_keypair(), zmq.curve_keypair())

    def env(self, role: str) -> dict[str, str]:
        """The environment variables that give a worker of `role` its keys."""
        (server_pub, server_sec), (client_pub, client_sec) = self.server, self.client
        if role == "encoder":
            curve = {ENV_SECRET_KEY: server_sec.decode(), ENV_ALLOWED_CLIENTS: client_pub.decode()}
        else:
            curve = {ENV_SECRET_KEY: client_sec.decode(), ENV_SERVER_KEY: server_pub.decode()}
        return {"EPD_INTERNAL_KEY": self.internal_key, **curve}

    def proxy_curve(self) -> CurveConfig:
        (server_pub, _), (client_pub, client_sec) = self.server, self.client
        return CurveConfig(secret_key=client_sec, public_key=client_pub, server_key=server_pub)


@dataclass(frozen=True)
class RestartPolicy:
    """A worker that exits is restarted after `backoff` s, doubling per restart in the window up to
    `backoff_max`; past `max_restarts` restarts within `window` s it is left down."""

    max_restarts: int = 5
    window: float = 600.0
    backoff: float = 1.0
    backoff_max: float = 30.0

    def __post_init__(self) -> None:
        assert self.max_restarts >= 0 and self.window > 0 and 0 <= self.backoff <= self.backoff_max

    def next_delay(self, restarts: collections.deque[float], now: float) -> float | None:
        """Seconds until a process that exited at `now` is restarted, given its past restart times (those
        older than the window are dropped from `restarts`); None: it has used up its restarts, leave it down."""
        while restarts and now - restarts[0] > self.window:
            restarts.popleft()
        if len(restarts) >= self.max_restarts:
            return None
        return min(self.backoff_max, self.backoff * 2 ** len(restarts))


@dataclass
class Worker:
    role: str
    url: str
    proc: subprocess.Popen[bytes]
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    restarts: collections.deque[float] = field(default_factory=collections.deque)  # monotonic restart times
    restart_at: float | None = None  # when an exited worker is due to be started again
    given_up: bool = False
    port_hold: socket.socket | None = field(default=None, repr=False)  # reserve_port's socket, closed by stop()
    started_at: float = field(default_factory=time.monotonic)  # monotonic time of its last (re)start

    @property
    def name(self) -> str:
        return f"{self.role} pid={self.proc.pid}"


@dataclass
class WorkerGroup:
    """The spawned workers; stop() is safe to call more than once."""

    workers: list[Worker] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # extra environment for every worker
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def spawn(self, role: str, model: str, host: str, threads: int, extra: list[str],
              env: dict[str, str] | None = None, port: int = 0) -> Worker:
        """`port`: the worker's HTTP port (0: a fresh one); SystemExit naming it when another process holds it."""
        try:  # held until stop(): no other process takes the port before or between starts
            hold = reserve_port(host, port)
        except OSError as exc:
            raise SystemExit(f"disagg-epd-proxy: error: cannot reserve port {port} on {host} for a {role} "
                             f"({exc.strerror or exc}); pick another --worker-base-port") from None
        port = hold.getsockname()[1]
        cmd = [sys.executable, "-m", WORKER_MODULES[role], "--model", model, "--host", host, "--port", str(port),
               *extra]
        # PYTHONUNBUFFERED: a worker's lines reach the launcher's stdout as they are written, a pipe included
        full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
                    **self.env, **(env or {}), ENV_REUSE_PORT: "1", "PYTHONUNBUFFERED": "1"}
        worker = Worker(role=role, url=f"http://{host}:{port}", proc=_popen(cmd, full_env), cmd=cmd, env=full_env,
                        port_hold=hold)
        self.workers.append(worker)
        logger.info("started %s pid=%d at %s", role, worker.proc.pid, worker.url)
        return worker

    def wait_healthy(self, timeout: float, progress_every: float = _PROGRESS_S) -> None:
        """Wait until every worker answers /health, logging each one's progress: a model takes a minute to load,
        and the launcher would be silent meanwhile."""
        start = time.monotonic()
        deadline, next_note, loading = start + timeout, start + progress_every, list(self.workers)
        logger.info("loading the model in %d worker(s); up to %.0f s (--startup-timeout)", len(loading), timeout)
        while loading := [w for w in loading if not self._ready(w)]:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"{loading[0].role} at {loading[0].url} not healthy after {timeout}s")
            if now >= next_note:
                next_note = now + progress_every
                logger.info("still loading after %.0f s: %s", now - start, ", ".join(w.name for w in loading))
            time.sleep(0.2)
        logger.info("all %d worker(s) ready in %.1f s", len(self.workers), time.monotonic() - start)

    @staticmethod
    def _ready(w: Worker) -> bool:
        """One look at a loading worker: True (and logged) once /health answers; RuntimeError if it exited."""
        if healthy(w.url):
            logger.info("%s at %s ready in %.1f s", w.name, w.url, time.monotonic() - w.started_at)
            return True
        if w.proc.poll() is not None:
            raise RuntimeError(f"{w.role} at {w.url} exited with code {w.proc.returncode} during startup")
        return False

    def supervise(self) -> None:
        """Watch the workers from a thread of its own (it also spawns the restarts: see _die_with_parent)."""
        self._thread = threading.Thread(target=self._supervise, name="epd-supervisor", daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(_POLL_S):
            for w in list(self.workers):  # --autoscale adds and retires workers from its own thread
                self.check(w, time.monotonic())

    def check(self, w: Worker, now: float) -> None:
        """One look at one worker: note an exit, and restart it when its backoff is over."""
        if w.given_up or w.proc.poll() is None or self._stopping.is_set():
            return
        if w.restart_at is None:
            self._schedule_restart(w, now)
        elif now >= w.restart_at:
            w.restart_at = None
            w.restarts.append(now)
            w.proc, w.started_at = _popen(w.cmd, w.env), time.monotonic()
            logger.warning("restarted %s at %s: pid=%d (restart %d in the last %.0f s)", w.role, w.url,
                           w.proc.pid, len(w.restarts), self.policy.window)

    def _schedule_restart(self, w: Worker, now: float) -> None:
        code, delay = w.proc.returncode, self.policy.next_delay(w.restarts, now)
        if delay is None:
            w.given_up = True
            logger.error("%s at %s exited with code %s; not restarting it: %d restarts in the last %.0f s "
                         "(--max-restarts); the proxy serves with the other workers", w.role, w.url, code,
                         len(w.restarts), self.policy.window)
            return
        w.restart_at = now + delay
        logger.warning("%s at %s exited with code %s; restarting it in %.1f s", w.role, w.url, code, delay)

    def retire(self, worker: Worker, grace: float) -> int | None:
        """Stop one worker for good (--autoscale scaling down, after the proxy stopped sending it work): no longer
        supervised, SIGTERM (it drains what it holds: epd_common.admission), SIGKILL `grace` s later; its port is
        released. Returns its exit code."""
        worker.given_up = True  # a supervisor look already under way does not schedule a restart
        if worker in self.workers:
            self.workers.remove(worker)
        if worker.proc.poll() is None:
            worker.proc.terminate()
        try:
            code = worker.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            code = worker.proc.wait()
        if worker.port_hold is not None:
            worker.port_hold.close()
        logger.info("retired %s at %s (exit code %s)", worker.role, worker.url, code)
        return code

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to every worker (each drains: epd_common.admission), SIGKILL to those still up `grace` s later."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.terminate()
        deadline = time.monotonic() + grace
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            if w.port_hold is not None:
                w.port_hold.close()
        self.workers.clear()


def _popen(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509


def healthy(url: str) -> bool:
    """Whether the worker at `url` answers /health with 200 now."""
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
