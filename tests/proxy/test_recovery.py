"""A decoder that finds an embedding nowhere gets it re-encoded and the request retried, once."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.errors import APIError
from proxy.app import Generation
from proxy.prepare import PreparedChat
from scheduler.scheduler import MMItem


class FakeFleet:
    """Records calls; the decoder misses `misses` times, listing hash 'b'."""

    def __init__(self, misses: int):
        self.misses = misses
        self.encode_calls: list[tuple[list[str], bool]] = []
        self.payloads: list[dict[str, Any]] = []
        self.released = 0
        self.cfg = type("Cfg", (), {"aggregated": False})()
        self.metrics = type("M", (), {"retries": type("C", (), {"inc": lambda self: None})()})()

    def acquire_decoder(self) -> int:
        return 0

    def release_decoder(self, index: int) -> None:
        self.released += 1

    async def encode(self, items: list[MMItem], request_id: str, skip_cached: bool = True) -> dict[str, str]:
        self.encode_calls.append(([i.mm_hash for i in items], skip_cached))
        return {i.mm_hash: "tcp://re-encoded" for i in items}

    async def open_generation(self, index: int, payload: dict[str, Any], request_id: str) -> object:
        self.payloads.append(payload)
        if len(self.payloads) <= self.misses:
            raise APIError(409, "missing", code="missing_embeddings", extra={"missing": ["b"]})
        return object()


CHAT = PreparedChat(messages=[], items=[MMItem("a", b"1"), MMItem("b", b"2")], sampling={})
SOURCES = {"a": "tcp://e0", "b": "tcp://e1"}


def test_missing_embedding_is_re_encoded_and_the_request_retried() -> None:
    fleet = FakeFleet(misses=1)
    gen = Generation(fleet, CHAT, "rid")  # type: ignore[arg-type]
    asyncio.run(gen.open(SOURCES))
    assert fleet.encode_calls == [(["b"], False)]  # only the missing item, cache check bypassed
    assert [im["source"] for im in fleet.payloads[1]["images"]] == ["tcp://e0", "tcp://re-encoded"]


def test_a_second_miss_is_a_retryable_503_not_a_loop() -> None:
    fleet = FakeFleet(misses=2)
    gen = Generation(fleet, CHAT, "rid")  # type: ignore[arg-type]
    with pytest.raises(APIError) as err:
        asyncio.run(gen.open(SOURCES))
    assert err.value.status == 503 and len(fleet.payloads) == 2
    asyncio.run(gen.close())
    assert fleet.released == 1
