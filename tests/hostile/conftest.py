"""Shared fixture of the hostile suite: one real stack per test module."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hostile.stack import HostileStack, hostile_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileStack]:
    """Proxy + one encoder + one decoder of the demo model, as processes on loopback (URLs, pids, logs)."""
    with hostile_stack(tmp_path_factory.mktemp("hostile")) as s:
        yield s
