"""A live producer and a consumer on tcp loopback, and a K/V client, closed after each test.

They use the socket path (shared memory off); tests/connector/test_connector_shm.py covers shared memory.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from connector.tensors.consumer import ECConsumer
from connector.tensors.kv_client import KVClient
from connector.tensors.producer import ECProducer


@pytest.fixture
def producer() -> Iterator[ECProducer]:
    p = ECProducer(shm=False).start()
    yield p
    p.close()


@pytest.fixture
def consumer() -> Iterator[ECConsumer]:
    c = ECConsumer(shm=False)
    yield c
    c.close()


@pytest.fixture
def client() -> Iterator[KVClient]:
    """A decode worker's K/V client (connector/tensors/kv_client.py)."""
    c = KVClient()
    yield c
    c.close()
