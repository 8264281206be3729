"""The proxy app: module-level routes around one ProxyState that the lifespan starts and stops."""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.state import ProxyState

AUTH = {"Authorization": "Bearer inner"}


def config() -> ProxyConfig:
    """No worker to wait for: the lifespan starts at once, workers register through /instances."""
    return ProxyConfig(encode_urls=(), decode_urls=(), dynamic_registration=True, internal_key="inner")


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(config())) as c:
        yield c


def test_before_the_lifespan_started_health_and_ready_say_starting() -> None:
    client = TestClient(create_app(config()))  # no `with`: the lifespan does not run
    for path in ("/health", "/ready"):
        resp = client.get(path)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "not_ready"
        assert "proxy is starting" in resp.json()["error"]["message"]


def test_the_lifespan_starts_the_fleet() -> None:
    app = create_app(config())
    state: ProxyState = app.state.proxy
    assert state.started is None
    with TestClient(app) as c:
        assert state.started is not None
        assert c.get("/health").json() == {"status": "ok", "role": "proxy"}  # the details need the internal key
        assert c.get("/health", headers=AUTH).json() == {"status": "ok", "role": "proxy", "pid": os.getpid(),
                                                         "encoders": [], "decoders": [], "prefills": []}  # pid: who


def test_ready_names_the_missing_role(client: TestClient) -> None:
    resp = client.get("/ready")
    assert resp.status_code == 503 and resp.json()["error"]["message"] == \
        "not ready: no healthy decoder (none registered)"


def test_instances_need_the_internal_key(client: TestClient) -> None:
    assert client.get("/instances").status_code == 401
    assert client.get("/instances", headers=AUTH).json() == {"encoders": [], "decoders": [], "prefills": []}
    resp = client.request("DELETE", "/instances", json={"role": "decoder", "url": "http://127.0.0.1:1"}, headers=AUTH)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


def test_registration_is_off_without_an_internal_key() -> None:
    cfg = ProxyConfig(encode_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",))
    resp = TestClient(create_app(cfg)).get("/instances", headers=AUTH)  # refused before the fleet is asked
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "registration_disabled"


def test_a_chat_with_no_decoder_is_a_503_counted_by_status(client: TestClient) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "decoder_unavailable"
    text = client.get("/metrics").text
    assert 'epd_proxy_requests_total{endpoint="/v1/chat/completions",status="503"} 1.0' in text
    assert "epd_proxy_requests_in_flight 0.0" in text and "_created" not in text  # counters: `_total` alone


def test_an_insecure_proxy_lists_its_workers_without_the_key_but_registration_stays_keyed() -> None:
    with TestClient(create_app(replace(config(), insecure=True))) as client:
        assert client.get("/instances").json() == {"encoders": [], "decoders": [], "prefills": []}
        worker = {"role": "decoder", "url": "http://127.0.0.1:1"}
        for method in ("POST", "DELETE"):
            resp = client.request(method, "/instances", json=worker)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_internal_key"
        assert client.get("/instances").json()["decoders"] == []  # nothing was added
