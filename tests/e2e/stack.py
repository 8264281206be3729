"""Start the real system (launcher or separate workers) as processes on loopback, and read it back."""
from __future__ import annotations

import base64
import io
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from epd_builders.shapes import draw_shape
from epd_common.server import ENV_REUSE_PORT
from epd_launcher.group import reserve_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Stack:
    base_url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.base_url}{path}", timeout=30)

    def info(self) -> dict[str, Any]:
        """The proxy's /health with its details (pid, every worker's URL, health and load): needs the internal key,
        which the launcher made for this start and gave its children through their environment (read back here, so
        the stack still makes its own keys)."""
        headers = {"Authorization": f"Bearer {internal_key(self.proc.pid)}"}
        return dict(httpx.get(f"{self.base_url}/health", headers=headers, timeout=30).json())

    def worker_pid(self, url: str) -> int:
        """The pid of the worker at `url`, from its /health: shown only with the internal key."""
        return int(health(url, internal_key(self.proc.pid))["pid"])


def internal_key(launcher_pid: int) -> str:
    """The internal key in the environment of one of the launcher's children (its workers)."""
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                key = environ(int(child)).get("EPD_INTERNAL_KEY")
            except (ProcessLookupError, FileNotFoundError):  # a child that exited meanwhile (a worker restarting)
                continue
            if key:
                return key
    raise AssertionError(f"no child of the launcher {launcher_pid} holds an internal key")


def environ(pid: int) -> dict[str, str]:
    """A process's environment (same user only), from /proc."""
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 240) -> None:
    """Poll /health until 200; fail at once if the process died (readiness, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s:\n{log.read_text()[-3000:]}")


def start(module: str, args: list[str], log: Path, env: dict[str, str] | None = None,
          held: bool = False) -> subprocess.Popen[bytes]:
    """`python -m module args` from the repo root, output to `log`; `env` replaces this process's environment;
    `held`: the caller holds its --port (tests/ports.py), so it binds beside the hold (EPD_REUSE_PORT=1).

    EPD_INSECURE by default: these tests exercise other things; workers are secure by default
    (tests/hostile/test_trust.py)."""
    base = {**os.environ, "EPD_INSECURE": "1"} if env is None else env
    env = {**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **({ENV_REUSE_PORT: "1"} if held else {})}
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=env)


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@contextmanager
def launched(tmp: Path, *args: str) -> Iterator[Stack]:
    """The launcher on a port held for it from the pick to its bind (no other program on the machine can take it
    meanwhile: epd_launcher.group.reserve_port; the launcher binds it beside the hold, EPD_REUSE_PORT=1)."""
    with reserve_port() as hold:
        port = hold.getsockname()[1]
        log = tmp / f"launcher-{port}.log"
        env = {**os.environ, "EPD_INSECURE": "1", ENV_REUSE_PORT: "1"}
        proc = start("epd_launcher.cli", ["--port", str(port), *args], log, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, log)
            yield Stack(base_url=url, proc=proc, log=log)
        finally:
            stop(proc)


def metric(text: str, name: str) -> float:
    """Sum of all samples of one metric in Prometheus text format."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of a dead launcher still answers kill(0); check its state
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def health(url: str, key: str | None = None) -> dict[str, Any]:
    """A worker's /health; with the internal key it adds the worker's pid."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return dict(httpx.get(f"{url}/health", headers=headers, timeout=10).json())


def demo_png(colour: str, seed: int, shape: str = "circle") -> bytes:
    """A demo-style picture: a shape of `colour`, its size and place drawn from `seed` (distinct bytes)."""
    buf = io.BytesIO()
    draw_shape(colour, shape, random.Random(seed)).save(buf, format="PNG")
    return buf.getvalue()


def ask_colour(base_url: str, *images: bytes, api_key: str | None = None,
               headers: dict[str, str] | None = None, model: str = "demo") -> httpx.Response:
    """POST the demo's colour question about `images` (greedy, 4 tokens) to a proxy, with `headers` too (`model`:
    e.g. a LoRA adapter's name)."""
    urls = ["data:image/png;base64," + base64.b64encode(im).decode() for im in images]
    content = [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
               {"type": "text", "text": "What color is the shape?"}]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, headers={**auth, **(headers or {})}, timeout=60)


def urls_of(stack: Stack, role: str) -> list[str]:
    """The URLs of the proxy's `role` ("encoders" / "decoders") from its /health (with the internal key)."""
    return [w["url"] for w in stack.info()[role]]
