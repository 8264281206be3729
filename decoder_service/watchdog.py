"""The engine watchdog: a decoder whose engine died or stalled says so and exits non-zero.

/health reads `Engine.problem()` directly (cheap: a few attribute reads). This thread polls the same
answer and, on the first problem, logs it and calls `on_fatal` once. The default handler lets /health
answer 503 for a short grace (error events already sent reach their clients), then ends the process with
EXIT_ENGINE_FAILED. It does not wait for a graceful uvicorn shutdown: a stalled engine may never let the
streams it holds finish, and uvicorn re-raises the SIGTERM it handled, which would hide the exit code.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger("epd.decoder")
EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE: the launcher restarts a worker that exits
_MAX_POLL_S = 1.0

FatalHandler = Callable[[str, str], None]  # (code, reason) -> None


class HasProblem(Protocol):
    def problem(self) -> tuple[str, str] | None: ...


class Watchdog:
    """Polls `engine.problem()` every min(1 s, stall_timeout / 4); calls `on_fatal(code, reason)` once."""

    def __init__(self, engine: HasProblem, on_fatal: FatalHandler, stall_timeout: float):
        self.engine, self.on_fatal = engine, on_fatal
        self.interval = min(_MAX_POLL_S, stall_timeout / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epd-engine-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            problem = self.engine.problem()
            if problem is not None:
                logger.critical("decoder cannot serve (%s): %s; exiting with status %d", *problem, EXIT_ENGINE_FAILED)
                self.on_fatal(*problem)
                return


def exit_process(grace_s: float = 2.0) -> FatalHandler:
    """The default fatal handler: exit with EXIT_ENGINE_FAILED after `grace_s` (for /health and error events)."""

    def handler(code: str, reason: str) -> None:
        timer = threading.Timer(grace_s, _exit)
        timer.daemon = False  # NOTE: must fire even if the main thread is on its way out
        timer.start()

    return handler


def _exit() -> None:
    logging.shutdown()  # flush the log line that says why
    os._exit(EXIT_ENGINE_FAILED)
