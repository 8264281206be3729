"""Shared factories: tiny models are built once per session into a temp dir."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from epd_builders.tiny import FAMILIES, TinySpec, build_tiny
from epd_models.processors import register_processors
from tests.ports import PortHolds
from tests.quant_models import QuantModels

register_processors()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", help="where tests/models/test_parity.py and test_device.py put "
                     "models and tensors: cpu (default), cuda or cuda:N (python -m epd_bench.gpu_check passes it)")


@pytest.fixture(autouse=True)
def _scheduling_left_as_found() -> Iterator[None]:
    """A test leaves this thread's scheduling policy as it found it: a real-time policy left behind is inherited by
    every thread started later and can starve the whole run on two CPUs (tests/factories.py ordinary_scheduling)."""
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    yield
    after = os.sched_getscheduler(0), os.sched_getparam(0)
    if after != before:
        os.sched_setscheduler(0, *before)
        pytest.fail(f"the test left the scheduling policy changed: {before} -> {after} (put back)")


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> str:
    """The --device option."""
    return str(pytestconfig.getoption("--device"))


class TinyModels(dict[str, Path]):
    """family -> dir of a tiny random model (LM weights scaled so greedy output varies), built on first use."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> Path:
        assert family in FAMILIES, f"unknown family {family!r}"
        self[family] = build_tiny(TinySpec(family=family, lm_scale=3.0), self.root / family)
        return self[family]


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return TinyModels(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def quant_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> QuantModels:
    """(family, format) -> (quantized checkpoint, its dequantized twin), built on first use."""
    return QuantModels(tmp_path_factory.mktemp("quant"))


@pytest.fixture
def port_holds() -> Iterator[PortHolds]:
    """Ports held for the test's child processes (started with EPD_REUSE_PORT=1) and dead URLs; released after it."""
    with PortHolds() as holds:
        yield holds
