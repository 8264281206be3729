"""The decoder loads its LM and builds its engine (packing the linears, zeroing the K/V pool) on threads that have
ended by the time it serves, so the engine thread holds the process's only OpenMP team (epd_common/torch_threads.py;
the mechanism's own test is tests/test_torch_threads.py)."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import decoder_service.server as server
from decoder_service.config import DecoderConfig


def recording(fn: Any, threads: dict[str, threading.Thread], name: str) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        threads[name] = threading.current_thread()
        return fn(*args, **kwargs)
    return wrapped


def test_the_lm_loads_and_the_engine_is_built_on_threads_that_are_gone_when_it_serves(
        tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    threads: dict[str, threading.Thread] = {}
    monkeypatch.setattr(server, "load_language", recording(server.load_language, threads, "load"))
    monkeypatch.setattr(server, "Engine", recording(server.Engine, threads, "engine"))
    app = server.create_app(DecoderConfig(model=str(tiny_model_dirs["llava"])), on_fatal=lambda code, reason: None)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        engine_thread = app.state.decoder.engine._thread
        assert set(threads) == {"load", "engine"}
        for what, thread in threads.items():
            assert thread.name == "epd-setup" and not thread.is_alive(), what
            assert thread is not engine_thread and thread is not threading.current_thread(), what
