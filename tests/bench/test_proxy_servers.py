"""epd_bench.proxy_servers: the fake decoder's answers follow the decoder's contract (so the real proxy streams a chat
completion through it), and it keeps connections alive (so the bench's proxy-to-decoder hop is not reconnecting)."""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import httpx
import msgspec
import pytest
from fastapi.testclient import TestClient

from epd_bench.proxy_servers import TOKENS, FakeDecoder, make_app
from epd_contracts.generate import Event
from proxy.app import create_app
from proxy.config import ProxyConfig


@pytest.fixture
def fake() -> Iterator[FakeDecoder]:
    """The fake decoder on its own event loop in a thread, as it runs beside a proxy."""
    loop = asyncio.new_event_loop()
    decoder = FakeDecoder()
    loop.run_until_complete(decoder.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield decoder
    asyncio.run_coroutine_threadsafe(decoder.close(), loop).result(timeout=5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def test_generate_answers_contract_events_over_one_kept_alive_connection(fake: FakeDecoder) -> None:
    with httpx.Client(base_url=fake.url) as client:
        assert client.get("/health").json()["model"] == "demo"
        for _ in range(3):
            resp = client.post("/generate", content=b'{"messages": []}')
            events = [msgspec.json.decode(line, type=Event) for line in resp.content.splitlines()]
            assert [ev.text for ev in events if ev.type == "delta"] == list(TOKENS)
            assert events[-1].type == "done" and events[-1].usage is not None
        assert client.get("/nowhere").status_code == 404
    assert fake.generated == 3


def test_the_real_proxy_streams_a_chat_completion_through_it(fake: FakeDecoder) -> None:
    cfg = ProxyConfig(encode_urls=(), decode_urls=(fake.url,), aggregated=True, startup_timeout=10.0)
    body = {"model": "demo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(cfg)) as client, client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "".join(TOKENS) and data[-1] == "[DONE]"
    assert fake.generated == 1


def test_the_passthrough_forwards_the_decoders_bytes(fake: FakeDecoder) -> None:
    with TestClient(make_app(fake.url)) as client:
        resp = client.post("/v1/chat/completions", json={"messages": []})
        assert resp.status_code == 200
        assert [msgspec.json.decode(line, type=Event).text for line in resp.content.splitlines()][:3] == list(TOKENS)
        assert client.get("/other").status_code == 404
    assert fake.generated == 1
