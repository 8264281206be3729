"""Fixtures of the proxy tests."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

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
