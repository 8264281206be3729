"""Fixtures of the proxy tests."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from proxy.app import create_app
from proxy.config import ProxyConfig
from tests.proxy.fake_decoder import FakeDecoder
from tests.proxy.media_helpers import CountingServer, running


@pytest.fixture
def server() -> Iterator[CountingServer]:
    """A real HTTP server on loopback, in a thread, that counts the connections it accepts."""
    with running(CountingServer()) as srv:
        yield srv


@pytest.fixture
def no_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a TCP connection fails the test."""
    def forbidden(*args: object, **kwargs: object) -> socket.socket:
        raise AssertionError(f"a connection was attempted: {args}")
    monkeypatch.setattr(socket, "create_connection", forbidden)


@pytest.fixture
def decoder() -> Iterator[FakeDecoder]:
    """A fake decoder speaking the NDJSON contract (tests.proxy.fake_decoder); its prompts report cached tokens."""
    fake = FakeDecoder(cached_tokens=3)
    yield fake
    fake.close()


@pytest.fixture
def http(decoder: FakeDecoder) -> Iterator[TestClient]:
    """The proxy app (aggregated, in front of `decoder`), in process."""
    cfg = ProxyConfig(encode_urls=(), decode_urls=(decoder.url,), aggregated=True, startup_timeout=10.0)
    with TestClient(create_app(cfg)) as client:
        yield client


@pytest.fixture
def api(http: TestClient) -> openai.OpenAI:
    """The official client against the proxy app."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
