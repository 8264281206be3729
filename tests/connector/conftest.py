"""A live producer and a consumer on tcp loopback, closed after each test."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer


@pytest.fixture
def producer() -> Iterator[ECProducer]:
    p = ECProducer().start()
    yield p
    p.close()


@pytest.fixture
def consumer() -> Iterator[ECConsumer]:
    c = ECConsumer()
    yield c
    c.close()
