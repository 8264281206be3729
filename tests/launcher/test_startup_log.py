"""The launcher names each worker's progress while the workers load (a new user met 40-50 s of silence after
"started encoder pid=..."): which are still loading, and when each is ready, with the seconds it took.

The worker is tests/launcher/fake_worker.py (no model): it binds only once its --go file exists, and the test
creates that file when the launcher logs its first "still loading" line, so the worker is loading when that line
is written, whatever the machine's speed."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from epd_launcher.group import WorkerGroup


class _GoOnProgress(logging.Handler):
    """Lets the fake worker bind (creates its --go file) once the launcher reports it still loading."""

    def __init__(self, go: Path) -> None:
        super().__init__()
        self.go = go

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("still loading"):
            self.go.touch()


def test_wait_healthy_logs_each_worker_loading_then_ready_with_its_seconds(
        group: WorkerGroup, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    go = tmp_path / "go"
    w = group.spawn("decoder", "none", "127.0.0.1", 1, ["--go", str(go)])
    launcher_log = logging.getLogger("epd.launcher")
    release = _GoOnProgress(go)
    launcher_log.addHandler(release)
    try:
        with caplog.at_level(logging.INFO, logger="epd.launcher"):
            group.wait_healthy(timeout=120, progress_every=0.0)
    finally:
        launcher_log.removeHandler(release)
    lines = [r.getMessage() for r in caplog.records if r.name == "epd.launcher"]
    name = f"decoder pid={w.proc.pid}"
    loading = [i for i, line in enumerate(lines) if line.startswith("still loading after") and name in line]
    ready = [(i, m) for i, line in enumerate(lines)
             if (m := re.fullmatch(rf"{name} at {re.escape(w.url)} ready in (\d+\.\d) s", line))]
    assert loading and len(ready) == 1 and loading[0] < ready[0][0]
    assert float(ready[0][1].group(1)) > 0
    assert re.fullmatch(r"all 1 worker\(s\) ready in \d+\.\d s", lines[-1])
