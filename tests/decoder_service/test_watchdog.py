"""The engine never fails silently: a dead or stalled engine makes /health answer 503 with the reason, refuses
new work, ends its streams with an error, and the process exits non-zero."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from decoder_service.config import DecoderConfig
from decoder_service.shell import Engine
from decoder_service.watchdog import EXIT_ENGINE_FAILED
from epd_models.halves import LanguageHalf
from tests.decoder_service.conftest import served
from tests.decoder_service.engine_run import wait_until
from tests.ports import REUSE_PORT_ENV, held_port

TEXT = [{"role": "user", "content": [{"type": "text", "text": "Describe the image."}]}]
LONG = {"messages": TEXT, "sampling": {"max_tokens": 200, "ignore_eos": True, "temperature": 0}}
REPO = Path(__file__).resolve().parents[2]


class Fatal:
    """Records the watchdog's call instead of exiting the test process."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, code: str, reason: str) -> None:
        self.calls.append((code, reason))


@pytest.fixture
def watched(tiny_model_dirs: dict[str, Path], request: pytest.FixtureRequest) -> Iterator[tuple[str, Engine, Fatal]]:
    """A decoder whose watchdog reports to a recorder; the stall timeout is the test's parameter."""
    fatal = Fatal()
    cfg = DecoderConfig(engine_stall_timeout=request.param)
    with served(cfg, LanguageHalf(tiny_model_dirs["llava"]), on_fatal=fatal) as (url, ref):
        assert httpx.get(f"{url}/health").status_code == 200
        yield url, ref.engine, fatal


def first_delta_then_rest(url: str, body: dict[str, Any], started: threading.Event, out: list[dict]) -> None:
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line:  # a keep-alive
                continue
            out.append(json.loads(line))
            started.set()


@pytest.mark.parametrize("watched", [60.0], indirect=True)
def test_an_engine_fault_outside_any_request_is_503_engine_dead_and_fatal(
        watched: tuple[str, Engine, Fatal], monkeypatch: pytest.MonkeyPatch) -> None:
    url, engine, fatal = watched
    events: list[dict] = []
    started = threading.Event()
    stream = threading.Thread(target=first_delta_then_rest, args=(url, LONG, started, events))
    stream.start()
    assert started.wait(30)

    def broken() -> None:
        raise SystemError("injected engine fault")

    monkeypatch.setattr(engine.scheduler, "schedule", broken)  # runs every iteration, for no request in particular
    stream.join(timeout=30)
    assert events[-1]["type"] == "error"  # the running stream is told, not left hanging
    resp = httpx.get(f"{url}/health")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"
    assert "injected engine fault" in resp.json()["error"]["message"]
    assert wait_until(lambda: bool(fatal.calls)) and fatal.calls[0][0] == "engine_dead"
    refused = httpx.post(f"{url}/generate", json=LONG, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


@pytest.mark.parametrize("watched", [3.0], indirect=True)  # short, yet far above a busy machine's hiccups
def test_a_step_that_blocks_is_503_engine_stalled_after_the_timeout(
        watched: tuple[str, Engine, Fatal], monkeypatch: pytest.MonkeyPatch) -> None:
    url, engine, fatal = watched
    release = threading.Event()
    decode = engine.runner.run

    def blocked(*args: Any) -> Any:
        release.wait(30)
        return decode(*args)

    monkeypatch.setattr(engine.runner, "run", blocked)
    events: list[dict] = []
    stream = threading.Thread(target=first_delta_then_rest, args=(url, LONG, threading.Event(), events))
    stream.start()
    try:
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 503)
        body = httpx.get(f"{url}/health").json()["error"]
        assert body["code"] == "engine_stalled" and "--engine-stall-timeout" in body["message"]
        assert wait_until(lambda: bool(fatal.calls)) and fatal.calls[0][0] == "engine_stalled"
    finally:
        release.set()
        stream.join(timeout=60)
    assert events[-1]["type"] == "done"  # (in production the process has exited by now)


SCRIPT = """
import sys
from decoder_service import cli
from decoder_service.engine.llm_engine import LLMEngine

def broken(self, block):
    raise SystemError("injected engine fault")

LLMEngine._take_new_jobs = broken  # the engine thread dies at once, outside any request
cli.main(sys.argv[1:])
"""


@pytest.mark.e2e
def test_the_decoder_process_exits_non_zero_when_its_engine_dies(tiny_model_dirs: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), **REUSE_PORT_ENV}
    with held_port() as port:  # held for the process's life: it binds beside the hold
        args = ["--model", str(tiny_model_dirs["llava"]), "--port", str(port), "--insecure",
                "--engine-stall-timeout", "5"]
        proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
    assert proc.returncode == EXIT_ENGINE_FAILED
    assert "engine thread died: SystemError: injected engine fault" in proc.stderr
    assert "decoder cannot serve (engine_dead)" in proc.stderr
