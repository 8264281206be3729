"""SSE translation: chunks in order, finish and usage at the end, and a failure is never a silent truncation."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from epd_contracts.generate import Event
from proxy.metrics import ProxyMetrics
from proxy.openai_format import Completion
from proxy.streaming import sse_stream
from tests.openai_schema import assert_valid

USAGE = {"prompt_tokens": 70, "completion_tokens": 2, "total_tokens": 72, "num_image_tokens": 64}


class FakeGeneration:
    request_id = "rid"

    def __init__(self, events: list[dict[str, Any]]):
        self._events, self.closed = events, False

    async def events(self) -> AsyncIterator[Event]:
        for ev in self._events:
            yield msgspec.convert(ev, Event)  # as the proxy decodes the decoder's NDJSON lines

    async def close(self) -> None:
        self.closed = True


def run(events: list[dict[str, Any]], include_usage: bool = True) -> tuple[list[Any], FakeGeneration]:
    gen = FakeGeneration(events)

    async def collect() -> list[bytes]:
        it = sse_stream(gen, Completion(model="demo"), include_usage, ProxyMetrics(CollectorRegistry()),  # type: ignore[arg-type]
                  time.perf_counter())
        return [chunk async for chunk in it]

    return parse(asyncio.run(collect())), gen


def parse(writes: list[bytes]) -> list[Any]:
    """The SSE events of a stream's writes (one write may carry several events)."""
    frames = [f.removeprefix("data: ").strip() for f in b"".join(writes).decode().split("\n\n") if f.strip()]
    return [f if f == "[DONE]" else json.loads(f) for f in frames]


def test_a_burst_of_events_is_one_write_and_the_first_chunk_goes_with_the_first_token() -> None:
    gen = FakeGeneration([{"type": "delta", "text": "re"}, {"type": "delta", "text": "d"},
                          {"type": "done", "finish_reason": "stop", "usage": USAGE}])

    async def collect() -> list[bytes]:
        it = sse_stream(gen, Completion(model="demo"), True, ProxyMetrics(CollectorRegistry()),  # type: ignore[arg-type]
                        time.perf_counter())
        return [chunk async for chunk in it]

    writes = asyncio.run(collect())
    assert len(writes) == 1  # role, 2 deltas, finish, usage, [DONE]: all read before the stream asked
    assert len(parse(writes)) == 6


def test_events_that_arrive_apart_are_written_as_they_arrive() -> None:
    """A token is written before the decoder sends the next one: batching never holds a token back."""
    gate = asyncio.Event()

    class Gated(FakeGeneration):
        async def events(self) -> AsyncIterator[Event]:
            yield Event(type="delta", text="re")
            await gate.wait()  # the next token exists only after the first was written
            yield Event(type="delta", text="d")
            yield msgspec.convert({"type": "done", "finish_reason": "stop", "usage": USAGE}, Event)

    async def collect() -> list[bytes]:
        writes = []
        it = sse_stream(Gated([]), Completion(model="demo"), False, ProxyMetrics(CollectorRegistry()),  # type: ignore[arg-type]
                        time.perf_counter())
        async for chunk in it:
            writes.append(chunk)
            gate.set()
        return writes

    writes = asyncio.run(collect())
    first = parse(writes[:1])
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "re"}]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in parse(writes[1:])[:-1]) == "d"


def test_stream_has_role_deltas_finish_usage_and_done() -> None:
    out, gen = run([{"type": "delta", "text": "re"}, {"type": "delta", "text": "d"},
                    {"type": "done", "finish_reason": "stop", "usage": USAGE}])
    assert out[-1] == "[DONE]" and gen.closed
    for chunk in out[:-1]:
        assert_valid("CreateChatCompletionStreamResponse", chunk)
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in out[:-2]) == "red"
    assert out[-3]["choices"][0]["finish_reason"] == "stop"
    assert out[-2]["usage"] == {**{k: USAGE[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                                "prompt_tokens_details": {"cached_tokens": 0}}


def test_failure_after_first_token_ends_with_an_error_event() -> None:
    out, gen = run([{"type": "delta", "text": "re"}, {"type": "error", "message": "decoder connection lost"}])
    assert out[-1] == "[DONE]" and gen.closed
    assert out[-2]["error"]["message"] == "decoder connection lost"
    assert all(c["choices"][0]["finish_reason"] is None for c in out[:-2])


def test_stream_that_just_stops_is_not_silently_truncated() -> None:
    out, _ = run([{"type": "delta", "text": "re"}])
    assert out[-2]["error"]["code"] == "stream_interrupted" and out[-1] == "[DONE]"
