"""A WorkerGroup whose decoders are tests/launcher/fake_worker.py (no model), restarted without backoff."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from epd_launcher import group as group_module
from epd_launcher.group import RestartPolicy, WorkerGroup


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerGroup]:
    monkeypatch.setitem(group_module.WORKER_MODULES, "decoder", "tests.launcher.fake_worker")
    g = WorkerGroup(policy=RestartPolicy(backoff=0.0))
    yield g
    g.stop()
