"""Launcher mode: spawn N encoders and M decoders on this machine, wait for health, stop them all on exit."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger("epd.launcher")
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Child side: get SIGTERM if the launcher dies, even by SIGKILL (Linux), so nothing is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Worker:
    role: str
    url: str
    proc: subprocess.Popen[bytes]


@dataclass
class WorkerGroup:
    """The spawned workers; stop() is safe to call more than once."""

    workers: list[Worker] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every worker (e.g. its key)

    def spawn(self, role: str, model: str, host: str, threads: int, extra: list[str]) -> Worker:
        port = free_port(host)
        module = {"encoder": "encoder_service.server", "decoder": "decoder_service.server", "proxy": "proxy.cli"}[role]
        cmd = [sys.executable, "-m", module, "--model", model, "--host", host, "--port", str(port), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)), **self.env}
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        worker = Worker(role=role, url=f"http://{host}:{port}", proc=proc)
        self.workers.append(worker)
        logger.info("started %s pid=%d at %s", role, proc.pid, worker.url)
        return worker

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for w in self.workers:
            while not _healthy(w.url):
                if w.proc.poll() is not None:
                    raise RuntimeError(f"{w.role} at {w.url} exited with code {w.proc.returncode} during startup")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{w.role} at {w.url} not healthy after {timeout}s")
                time.sleep(0.2)

    def stop(self, grace: float = 15.0) -> None:
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
        self.workers.clear()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
