"""A fake OpenAI-compatible streaming server (and a fake EPD decoder API) on loopback, for epd-bench tests."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.ports import bound_socket, port_of, serve_in_thread


@dataclass
class FakeBehaviour:
    ttft_s: float = 0.02  # before the first token
    itl_s: float = 0.002  # between tokens
    usage: bool = True  # send a usage chunk (vLLM/EPD with include_usage; transformers serve always)
    done_line: bool = True  # end with `data: [DONE]` (transformers serve does not)
    fail_every: int = 0  # answer every n-th request with a 500
    model: str = "fake-model"
    tag_answers: bool = False  # answers read "r<request number>t<i> ...", so a test can tell them apart


@dataclass
class FakeServer:
    url: str
    behaviour: FakeBehaviour
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def _app(fake: FakeServer) -> FastAPI:
    app = FastAPI()
    b = fake.behaviour

    async def tokens(n: int, tag: str = "") -> AsyncIterator[str]:
        fake.in_flight += 1
        fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
        try:
            await asyncio.sleep(b.ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(b.itl_s)
                yield f"{tag}t{i} "
        finally:
            fake.in_flight -= 1

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": b.model, "object": "model"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        body = await request.json()
        fake.bodies.append(body)
        fake.auth.append(request.headers.get("authorization"))
        if b.fail_every and len(fake.bodies) % b.fail_every == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n, tag = int(body["max_tokens"]), f"r{len(fake.bodies)}" if b.tag_answers else ""
        messages = body["messages"]
        images = sum(1 for m in messages if isinstance(m["content"], list)
                     for part in m["content"] if part["type"] == "image_url")

        async def sse() -> AsyncIterator[bytes]:
            chunk = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()  # before generation, as the EPD proxy does
            async for text in tokens(n, tag):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': text}}]})}\n\n".encode()
            if b.usage:  # every message before the last counts as 10 cached tokens (as if a prefix cache held it)
                usage = {"prompt_tokens": 10 * len(messages) + 100 * images, "completion_tokens": n,
                         "total_tokens": n + 10, "prompt_tokens_details": {"cached_tokens": 10 * (len(messages) - 1)}}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            if b.done_line:
                yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/generate")
    async def generate(request: Request) -> StreamingResponse:
        body = await request.json()
        fake.bodies.append(body)
        n = int(body["sampling"]["max_tokens"])

        async def ndjson() -> AsyncIterator[bytes]:
            async for text in tokens(n):
                yield (json.dumps({"type": "delta", "text": text}) + "\n").encode()
            usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": n + 10}
            yield (json.dumps({"type": "done", "finish_reason": "length", "usage": usage}) + "\n").encode()

        return StreamingResponse(ndjson(), media_type="application/x-ndjson")

    return app


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[FakeServer]:
    """A FakeServer on a fresh loopback port (bound before it starts: tests/ports.py); parametrize indirectly with a
    FakeBehaviour to change it."""
    behaviour = getattr(request, "param", None) or FakeBehaviour()
    sock = bound_socket()
    fake = FakeServer(url=f"http://127.0.0.1:{port_of(sock)}", behaviour=behaviour)
    with serve_in_thread(uvicorn.Config(_app(fake), host="127.0.0.1", port=0, log_level="warning"), sock):
        yield fake
