"""A decoder app served by uvicorn in a thread, on the tiny LLaVA model (no encoders needed for text)."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from decoder_service.config import DecoderConfig
from decoder_service.server import DecoderState, create_app
from epd_launcher.group import free_port
from epd_models.halves import LanguageHalf


@contextmanager
def served(cfg: DecoderConfig, lm: LanguageHalf, **app_kw: Any) -> Iterator[tuple[str, DecoderState]]:
    """create_app(cfg, lm, **app_kw) served by uvicorn in a thread on cfg.port; yields (url, engine ref)."""
    app = create_app(cfg, lm=lm, **app_kw)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{cfg.port}", app.state.decoder
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def decoder(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[str, DecoderState]]:
    # a large prefill budget admits requests quickly, so 32 slots fill up under load
    cfg = DecoderConfig(port=free_port(), max_num_seqs=32, max_prefill_tokens=1024)
    with served(cfg, LanguageHalf(tiny_model_dirs["llava"])) as out:
        yield out
