"""A client that disconnects mid-stream stops its sequence at the next step; the next request runs."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from decoder_service.config import DecoderConfig
from decoder_service.engine import Engine
from decoder_service.server import create_app
from models.halves import LanguageHalf
from proxy.launcher import free_port

TEXT = [{"role": "user", "content": [{"type": "text", "text": "Describe the image."}]}]


@pytest.fixture
def decoder(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[str, dict[str, Engine]]]:
    port = free_port()
    app = create_app(DecoderConfig(port=port), lm=LanguageHalf(tiny_model_dirs["llava"]))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", app.state.engine_ref
    server.should_exit = True
    thread.join(timeout=30)


def wait_until(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


def test_disconnect_mid_stream_aborts_the_sequence(decoder: tuple[str, dict[str, Engine]]) -> None:
    url, ref = decoder
    body = {"messages": TEXT, "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        first = json.loads(next(lines))
        assert resp.status_code == 200 and first["type"] == "delta"
    engine = ref["engine"]
    assert wait_until(lambda: engine.finished["abort"] == 1 and engine.running is None)
    done = httpx.post(f"{url}/generate", json={**body, "max_tokens": 3}, timeout=30).text.splitlines()
    assert json.loads(done[-1])["finish_reason"] == "length" and engine.finished["length"] == 1
