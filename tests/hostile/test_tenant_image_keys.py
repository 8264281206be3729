"""A client never names what an image is cached under: vLLM's `uuid` (on the part or in
image_url) and an `mm_hash`, like any key image_url does not define, are a 400 `unsupported_parameter` naming the
key before any image is loaded or any worker is called; the proxy hashes the bytes. The proxy app in process, in
front of a fake decoder."""
from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from epd_contracts.hashing import mm_hash
from proxy.app import create_app
from proxy.config import ProxyConfig
from tests.e2e.stack import demo_png
from tests.proxy.fake_decoder import FakeDecoder


@pytest.fixture
def decoder() -> Iterator[FakeDecoder]:
    fake = FakeDecoder()
    yield fake
    fake.close()


@pytest.fixture
def client(decoder: FakeDecoder) -> Iterator[TestClient]:
    cfg = ProxyConfig(encode_urls=(), decode_urls=(decoder.url,), aggregated=True, startup_timeout=10.0)
    with TestClient(create_app(cfg)) as c:
        yield c


def body(image: bytes, part: dict[str, Any] | None = None, image_url: dict[str, Any] | None = None) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url, **(image_url or {})}, **(part or {})},
               {"type": "text", "text": "What color is the shape?"}]
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 2}


@pytest.mark.parametrize(("part", "image_url", "param"), [
    ({}, {"uuid": "shared-id"}, "messages.0.content.0.image_url.uuid"),
    ({}, {"mm_hash": "0" * 64}, "messages.0.content.0.image_url.mm_hash"),
    ({"uuid": "shared-id"}, {}, "messages.0.content.0.uuid"),
    ({}, {"cache_key": "x"}, "messages.0.content.0.image_url.cache_key"),
])
def test_a_client_cache_key_for_an_image_is_refused_by_name(client: TestClient, decoder: FakeDecoder,
                                                            part: dict[str, Any], image_url: dict[str, Any],
                                                            param: str) -> None:
    resp = client.post("/v1/chat/completions", json=body(demo_png("red", 1), part, image_url))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and resp.json()["error"]["code"] == "unsupported_parameter"
    assert decoder.bodies == []  # refused before any worker is asked


def test_a_null_uuid_is_off_and_each_image_is_named_by_its_own_bytes(client: TestClient,
                                                                      decoder: FakeDecoder) -> None:
    images = [demo_png("red", 2), demo_png("blue", 3)]
    for image in images:
        resp = client.post("/v1/chat/completions", json=body(image, {"uuid": None}, {"uuid": None}))
        assert resp.status_code == 200, resp.text
    assert [b["images"][0]["mm_hash"] for b in decoder.bodies] == [mm_hash(im) for im in images]
