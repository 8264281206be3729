"""Generation: a gather miss is re-encoded once; a decoder that fails before the first token is replaced
by another decoder without the client noticing; after the first token the stream ends with an error."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import msgspec
import pytest

from epd_common.errors import APIError
from epd_contracts.generate import GenerateRequest
from epd_contracts.sampling import SamplingParams
from proxy.generation import Generation
from proxy.image import ImageItem
from proxy.prepare import PreparedChat
from proxy.upstream import WorkerFailed
from proxy.worker_state import Worker
from proxy.workers import Workers
from scheduler.scheduler import MMItem

USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4, "num_image_tokens": 0, "cached_tokens": 0}
DONE = {"type": "done", "finish_reason": "stop", "usage": USAGE}


class FakeStream:
    """A decoder's NDJSON stream: `events`, then (optionally) a dropped connection."""

    def __init__(self, events: list[dict[str, Any]], drop: bool = False):
        self.events, self.drop, self.closed = events, drop, False

    async def aiter_lines(self) -> AsyncIterator[str]:
        for ev in self.events:
            yield json.dumps(ev)
        if self.drop:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    async def aclose(self) -> None:
        self.closed = True


class Count:
    """A prometheus counter's inc(), counted."""

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1


class FakeFleet:
    """Real worker bookkeeping; decoders behave as scripted: url -> list of outcomes, one per open."""

    def __init__(self, script: dict[str, list[Any]]):
        self.script = script
        self.workers = Workers(None, 1.0, 1.0, 3, on_up=lambda w: None, on_down=lambda w: None)  # type: ignore[arg-type]
        for url in script:  # "p..." URLs are prefill workers (E -> P -> D)
            self.workers.add("prefill" if url.startswith("p") else "decoder", url).healthy = True
        self.encode_calls: list[tuple[list[str], bool]] = []
        self.opened: list[tuple[str, dict[str, Any]]] = []
        self.failed: list[tuple[str, bool]] = []
        self.released: list[tuple[str, list[str]]] = []  # (decoder, the keys it was told it holds now)
        self.cfg = type("Cfg", (), {"aggregated": False})()
        self.metrics = type("M", (), {name: Count() for name in ("retries", "handoffs", "handoffs_declined")})()
        self.acquired: list[tuple[str, list[str]]] = []  # (worker, the prefix keys it was chosen by)

    @property
    def splits_prefill(self) -> bool:
        return bool(self.workers.of("prefill"))

    def acquire_decoder(self, exclude: set[str], prefix_keys: Sequence[str] = (), role: str = "decoder",
                        lora: str = "") -> Worker:
        worker = self.workers.acquire_decoder(exclude, prefix_keys, role)
        self.acquired.append((worker.url, list(prefix_keys)))
        return worker

    def release_decoder(self, worker: Worker, finished_keys: Sequence[str] = ()) -> None:
        worker.load -= 1
        self.released.append((worker.url, list(finished_keys)))

    def decoder_failed(self, worker: Worker, reason: str, mark_down: bool) -> None:
        self.failed.append((worker.url, mark_down))
        if mark_down:
            self.workers.mark_down(worker, reason)

    async def encode(self, items: list[MMItem], request_id: str, skip_cached: bool = True) -> dict[str, str]:
        self.encode_calls.append(([i.mm_hash for i in items], skip_cached))
        return {i.mm_hash: "tcp://re-encoded" for i in items}

    async def open_generation(self, worker: Worker, body: GenerateRequest, request_id: str) -> object:
        self.opened.append((worker.url, msgspec.to_builtins(body)))  # the body as it goes on the wire
        outcome = self.script[worker.url].pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


CHAT = PreparedChat(messages=[{"role": "user", "content": "hi"}], items=[ImageItem(MMItem("a", b"1")), ImageItem(MMItem("b", b"2"))], sampling=SamplingParams())
SOURCES = {"a": "tcp://e0", "b": "tcp://e1"}
MISSING_B = APIError(409, "missing", code="missing_embeddings", extra={"missing": ["b"]})


async def run(fleet: FakeFleet) -> tuple[Generation, list[dict[str, Any]]]:
    gen = Generation(fleet, CHAT, "rid")  # type: ignore[arg-type]
    await gen.open(SOURCES)
    events = [msgspec.to_builtins(ev) async for ev in gen.events()]
    await gen.close()
    return gen, events


def delta(text: str) -> dict[str, Any]:
    return {"type": "delta", "text": text}


def test_missing_embedding_is_re_encoded_and_the_request_retried() -> None:
    fleet = FakeFleet({"d0": [MISSING_B, FakeStream([delta("x"), DONE])]})
    _, events = asyncio.run(run(fleet))
    assert fleet.encode_calls == [(["b"], False)]  # only the missing item, cache check bypassed
    assert [im["source"] for im in fleet.opened[1][1]["images"]] == ["tcp://e0", "tcp://re-encoded"]
    assert events[-1] == DONE


def test_a_second_miss_is_a_retryable_503_not_a_loop() -> None:
    fleet = FakeFleet({"d0": [MISSING_B, MISSING_B]})
    gen = Generation(fleet, CHAT, "rid")  # type: ignore[arg-type]
    with pytest.raises(APIError) as err:
        asyncio.run(gen.open(SOURCES))
    assert err.value.status == 503 and len(fleet.opened) == 2
    assert fleet.workers.by_url["d0"].load == 0  # released on the error


def test_decoder_unreachable_at_open_is_replaced_by_another() -> None:
    fleet = FakeFleet({"d0": [WorkerFailed("ConnectError")], "d1": [FakeStream([delta("x"), DONE])]})
    _, events = asyncio.run(run(fleet))
    assert [url for url, _ in fleet.opened] == ["d0", "d1"] and events == [delta("x"), DONE]
    assert all(w.load == 0 for w in fleet.workers.of("decoder"))


def test_stream_lost_before_the_first_token_is_retried_on_another_decoder() -> None:
    dropped = FakeStream([], drop=True)
    fleet = FakeFleet({"d0": [dropped], "d1": [FakeStream([delta("hi"), DONE])]})
    _, events = asyncio.run(run(fleet))
    assert events == [delta("hi"), DONE]  # the client never sees the first decoder's failure
    assert dropped.closed and fleet.failed == [("d0", True)]
    assert not fleet.workers.by_url["d0"].healthy and all(w.load == 0 for w in fleet.workers.of("decoder"))
    assert fleet.opened[1][1] == fleet.opened[0][1]  # same payload, same embedding sources


def test_stream_lost_after_the_first_token_ends_with_an_error_event() -> None:
    fleet = FakeFleet({"d0": [FakeStream([delta("hi")], drop=True)], "d1": [FakeStream([DONE])]})
    _, events = asyncio.run(run(fleet))
    assert events[0] == delta("hi") and events[1]["type"] == "error" and len(events) == 2
    assert [url for url, _ in fleet.opened] == ["d0"]  # no retry: tokens were already sent


def test_every_decoder_failing_is_a_503() -> None:
    fleet = FakeFleet({"d0": [WorkerFailed("ConnectError")], "d1": [WorkerFailed("answered 500")]})
    gen = Generation(fleet, CHAT, "rid")  # type: ignore[arg-type]
    with pytest.raises(APIError) as err:
        asyncio.run(gen.open(SOURCES))
    assert err.value.status == 503 and err.value.code == "decoder_unavailable"
    assert all(w.load == 0 for w in fleet.workers.of("decoder"))


class RawStream(FakeStream):
    """A decoder stream of raw lines (not necessarily events)."""

    def __init__(self, lines: list[str]):
        super().__init__([])
        self.lines = lines

    async def aiter_lines(self) -> AsyncIterator[str]:
        for line in self.lines:
            yield line


@pytest.mark.parametrize("bad", ["not json", '{"type": "token"}', '{"type": "delta", "text": 5}', "[1, 2]"])
@pytest.mark.parametrize("position", [0, 1])
def test_an_unreadable_event_becomes_an_error_event_that_ends_the_stream(bad: str, position: int) -> None:
    lines = [json.dumps(delta("hi")), bad, json.dumps(DONE)][1 - position:] if position else [bad, json.dumps(DONE)]
    fleet = FakeFleet({"d0": [RawStream(lines)]})
    _, events = asyncio.run(run(fleet))
    error = events[position]
    assert error["type"] == "error" and "unreadable event" in error["message"]
    assert events[:position] == [delta("hi")] * position


def test_only_a_generation_that_finished_tells_its_decoder_holds_the_prompt() -> None:
    chat = PreparedChat(messages=CHAT.messages, items=CHAT.items, sampling=CHAT.sampling, prefix_keys=["k0"])

    async def released(script: dict[str, list[Any]]) -> list[tuple[str, list[str]]]:
        fleet = FakeFleet(script)
        gen = Generation(fleet, chat, "rid")  # type: ignore[arg-type]
        await gen.open(SOURCES)
        [ev async for ev in gen.events()]
        await gen.close()
        return fleet.released

    assert asyncio.run(released({"d0": [WorkerFailed("ConnectError")], "d1": [FakeStream([delta("x"), DONE])]})) \
        == [("d0", []), ("d1", ["k0"])]
    assert asyncio.run(released({"d0": [FakeStream([delta("x")], drop=True)]})) == [("d0", [])]
    error = {"type": "error", "message": "engine failed"}
    assert asyncio.run(released({"d0": [FakeStream([delta("x"), DONE, error])]})) == [("d0", [])]
