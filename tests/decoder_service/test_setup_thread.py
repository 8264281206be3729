"""The decoder loads its LM and builds its engine (packing the linears, zeroing the K/V pool) on threads that have
ended by the time it serves, and prepares requests on threads that run torch alone, so the engine thread holds the
process's only OpenMP team (epd_models/torch_threads.py; the mechanism's own test is
tests/models/test_torch_threads.py)."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

import decoder_service.startup as startup
from decoder_service.config import DecoderConfig
from decoder_service.server import create_app


def recording(fn: Any, threads: dict[str, threading.Thread], name: str) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        threads[name] = threading.current_thread()
        return fn(*args, **kwargs)
    return wrapped


def test_the_lm_loads_and_the_engine_is_built_on_threads_that_are_gone_when_it_serves(
        tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    threads: dict[str, threading.Thread] = {}
    monkeypatch.setattr(startup, "load_language", recording(startup.load_language, threads, "load"))
    monkeypatch.setattr(startup, "Engine", recording(startup.Engine, threads, "engine"))
    app = create_app(DecoderConfig(model=str(tiny_model_dirs["llava"])), on_fatal=lambda code, reason: None)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        engine_thread = app.state.decoder.engine._thread
        assert set(threads) == {"load", "engine"}
        for what, thread in threads.items():
            assert thread.name == "epd-setup" and not thread.is_alive(), what
            assert thread is not engine_thread and thread is not threading.current_thread(), what
        # the threads requests are prepared on (the loop's executor) run torch alone; the engine thread does not
        assert client.portal is not None
        assert client.portal.call(asyncio.to_thread, torch.get_num_threads) == 1
