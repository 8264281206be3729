"""A decoder app served by uvicorn in a thread, on the tiny LLaVA model (no encoders needed for text)."""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from decoder_service.config import DecoderConfig
from decoder_service.server import create_app
from decoder_service.shell import Engine
from decoder_service.state import DecoderState
from epd_models.halves import LanguageHalf
from tests.decoder_service.pool_invariants import pool_violations
from tests.ports import serve_in_thread


@pytest.fixture(autouse=True)
def pool_checked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every engine step of the test leaves the K/V pool whole (tests/decoder_service/pool_invariants.py): checked
    on the engine thread after each step (the blocks a step touches), and the whole pool of every engine that
    stepped, idle, when the test ends; reported then."""
    seen: list[str] = []
    engines: weakref.WeakSet[Engine] = weakref.WeakSet()
    step = Engine.step

    def checked(self: Engine) -> None:
        step(self)
        engines.add(self)
        seen.extend(f"after step: {v}" for v in pool_violations(self.runner, full=False) if v not in seen)

    monkeypatch.setattr(Engine, "step", checked)
    yield seen
    for engine in list(engines):
        if engine.dead is None and engine.scheduler.is_idle and engine.num_waiting == 0:
            seen.extend(f"at the end: {v}" for v in pool_violations(engine.runner))
    assert not seen, "the K/V pool broke its invariants:\n" + "\n".join(seen[:20])


@contextmanager
def served(cfg: DecoderConfig, lm: LanguageHalf, **app_kw: Any) -> Iterator[tuple[str, DecoderState]]:
    """create_app(cfg, lm, **app_kw) served by uvicorn in a thread on a socket bound before it starts (a fresh port:
    cfg.port is not used; tests/ports.py); yields (url, engine ref)."""
    app = create_app(cfg, lm=lm, **app_kw)
    with serve_in_thread(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")) as port:
        yield f"http://127.0.0.1:{port}", app.state.decoder


@pytest.fixture
def decoder(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[str, DecoderState]]:
    # a large prefill budget admits requests quickly, so 32 slots fill up under load
    cfg = DecoderConfig(max_num_seqs=32, max_prefill_tokens=1024)
    with served(cfg, LanguageHalf(tiny_model_dirs["llava"])) as out:
        yield out
