"""A real stack for hostile tests (proxy + one encoder + one decoder of the demo model on loopback), and the
"other users" a hostile request must not disturb (`run_victims`)."""
from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from epd_common.server import ENV_REUSE_PORT
from epd_launcher.group import reserve_port
from tests.e2e.stack import ask_colour, demo_png, pid_alive, start, stop, wait_healthy
from tests.hostile.memory import peak_rss_bytes, rss_bytes

ROLES = ("encoder", "decoder", "proxy")
_MODULES = {"encoder": "encoder_service.cli", "decoder": "decoder_service.cli", "proxy": "epd_launcher.cli"}
VICTIM_COLOURS = ("red", "green", "blue", "yellow")


@dataclass
class HostileStack:
    """Three processes; `procs`/`logs`/`urls` are keyed by role."""

    procs: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]
    urls: dict[str, str]
    internal_key: str = field(repr=False)

    @property
    def base_url(self) -> str:
        return self.urls["proxy"]

    @property
    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self.procs.items()}

    def dead(self) -> list[str]:
        """Roles whose process has exited (or is a zombie)."""
        return [role for role, p in self.procs.items() if p.poll() is not None or not pid_alive(p.pid)]

    def rss(self) -> dict[str, int]:
        return {role: rss_bytes(pid) for role, pid in self.pids.items()}

    def peak_rss(self) -> dict[str, int]:
        return {role: peak_rss_bytes(pid) for role, pid in self.pids.items()}

    def log_tail(self, role: str, chars: int = 3000) -> str:
        return self.logs[role].read_text(errors="replace")[-chars:]

    def answers_red(self) -> str:
        """An ordinary request's answer about a red circle (the demo model names the colour)."""
        resp = ask_colour(self.base_url, demo_png("red", 7))
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["message"]["content"])


def stack_env(internal_key: str) -> dict[str, str]:
    """Workers and proxy share one internal key; CURVE is explicitly off (EPD_INSECURE=1) on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    return {**env, "EPD_INSECURE": "1", "EPD_INTERNAL_KEY": internal_key, ENV_REUSE_PORT: "1"}


@contextmanager
def hostile_stack(tmp: Path, *, encoder_args: Sequence[str] = (), decoder_args: Sequence[str] = (),
                  proxy_args: Sequence[str] = (), timeout: float = 240) -> Iterator[HostileStack]:
    """Start encoder, decoder and proxy (attach mode) at once; yield when the proxy is healthy; stop all."""
    key = secrets.token_hex(16)
    with ExitStack() as holds:  # each port held from the pick to its process's bind (EPD_REUSE_PORT=1)
        ports = {role: holds.enter_context(reserve_port()).getsockname()[1] for role in ROLES}
        with _started(tmp, key, ports, encoder_args, decoder_args, proxy_args, timeout) as stack:
            yield stack


@contextmanager
def _started(tmp: Path, key: str, ports: dict[str, int], encoder_args: Sequence[str], decoder_args: Sequence[str],
             proxy_args: Sequence[str], timeout: float) -> Iterator[HostileStack]:
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    args = {
        "encoder": ["--model", "demo", "--port", str(ports["encoder"]), *encoder_args],
        "decoder": ["--model", "demo", "--port", str(ports["decoder"]), *decoder_args],
        "proxy": ["--port", str(ports["proxy"]), "--served-model-name", "demo",
                  "--encode-servers-urls", urls["encoder"], "--decode-servers-urls", urls["decoder"], *proxy_args],
    }
    logs = {role: tmp / f"{role}-{ports[role]}.log" for role in ROLES}
    with ExitStack() as cleanup:
        procs: dict[str, subprocess.Popen[bytes]] = {}
        for role in ROLES:
            procs[role] = start(_MODULES[role], args[role], logs[role], env=stack_env(key))
            cleanup.callback(stop, procs[role])
        for role in ROLES:
            wait_healthy(urls[role], procs[role], logs[role], timeout=timeout)
        yield HostileStack(procs=procs, logs=logs, urls=urls, internal_key=key)


# --- the other users ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamResult:
    """What one streaming client saw."""

    status: int
    text: str
    finish_reason: str | None
    completion_tokens: int | None
    error: dict[str, Any] | None  # an error event inside the stream, or the body of a non-200
    done: bool  # the stream ended with [DONE]


def victim_body(i: int, max_tokens: int = 64) -> dict[str, Any]:
    """An ordinary user's streaming request: a picture and a question, greedy, a fixed number of tokens."""
    url = "data:image/png;base64," + base64.b64encode(demo_png(VICTIM_COLOURS[i % 4], 9000 + i)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What color is the shape?"}]
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def stream_chat(base_url: str, body: dict[str, Any], on_first_token: Callable[[], None] | None = None,
                timeout: float = 120) -> StreamResult:
    """POST a streaming chat completion and read every SSE event."""
    text: list[str] = []
    finish, tokens, error, done = None, None, None, False
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            resp.read()
            return StreamResult(resp.status_code, "", None, None, _json_or_text(resp.text), False)
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        if not text and on_first_token is not None:
                            on_first_token()
                        text.append(piece)
    return StreamResult(200, "".join(text), finish, tokens, error, done)


def _json_or_text(text: str) -> dict[str, Any]:
    try:
        body = json.loads(text)
    except ValueError:
        return {"raw": text[:500]}
    return body if isinstance(body, dict) else {"raw": body}


@dataclass
class VictimRun:
    """Ordinary users' streams alone (`solo`) and side by side while something else ran (`together`)."""

    solo: list[StreamResult]
    together: list[StreamResult]
    during: Any = None  # what the `during` callable returned

    @property
    def solo_texts(self) -> list[str]:
        return [r.text for r in self.solo]

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.together]

    def assert_undisturbed(self) -> None:
        """Every concurrent stream finished cleanly with exactly the tokens it produced alone."""
        for alone, beside in zip(self.solo, self.together, strict=True):
            assert alone.status == 200 and alone.error is None and alone.done, f"solo run failed: {alone}"
            assert beside.status == 200 and beside.error is None and beside.done, f"victim disturbed: {beside}"
            assert (beside.text, beside.completion_tokens, beside.finish_reason) == \
                (alone.text, alone.completion_tokens, alone.finish_reason)


def run_victims(base_url: str, n: int = 2, during: Callable[[], Any] | None = None, max_tokens: int = 64,
                solo: list[StreamResult] | None = None, timeout: float = 120) -> VictimRun:
    """Run n ordinary streams one by one (unless `solo` is given), then all n at once; once every one of them
    has its first token, call `during()` (the hostile request) in this thread while they decode."""
    bodies = [victim_body(i, max_tokens) for i in range(n)]
    solo = solo if solo is not None else [stream_chat(base_url, b, timeout=timeout) for b in bodies]
    started = threading.Semaphore(0)
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(stream_chat, base_url, b, started.release, timeout) for b in bodies]
        for _ in range(n):  # a stream that fails never releases: the deadline bounds the wait
            if not started.acquire(timeout=timeout):
                break
        result = during() if during is not None else None
        together = [f.result(timeout=timeout) for f in futures]
    return VictimRun(solo=solo, together=together, during=result)


@contextmanager
def victims_throughout(base_url: str, n: int = 2, max_tokens: int = 24, timeout: float = 120) -> Iterator[VictimRun]:
    """n ordinary users streaming over and over, side by side, for as long as the block runs (at least once
    each); on exit `together` holds every stream they saw and `solo` each one's stream alone, repeated to match,
    so `assert_undisturbed()` checks every one of them."""
    bodies = [victim_body(i, max_tokens) for i in range(n)]
    alone = [stream_chat(base_url, b, timeout=timeout) for b in bodies]
    run = VictimRun(solo=[], together=[])
    stopping = threading.Event()

    def user(i: int) -> list[StreamResult]:
        seen = [stream_chat(base_url, bodies[i], timeout=timeout)]
        while not stopping.is_set():
            seen.append(stream_chat(base_url, bodies[i], timeout=timeout))
        return seen

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(user, i) for i in range(n)]
        try:
            yield run
        finally:
            stopping.set()
            for i, f in enumerate(futures):
                seen = f.result(timeout=timeout * 2)
                run.together += seen
                run.solo += [alone[i]] * len(seen)
