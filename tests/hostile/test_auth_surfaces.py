"""What the proxy serves without a key, and how it reads keys: the OpenAPI document needs the API
key when one is set (the browser pages, which cannot send it, are off); the Bearer scheme is case-insensitive
(RFC 7235) for the API key and the internal key alike; HEAD /health and /ready answer like GET, without a body."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from proxy.app import create_app
from proxy.config import ProxyConfig

API_KEY, INTERNAL_KEY = "api-s3cret", "internal-s3cret"


def proxy(api_key: str | None) -> TestClient:
    """No worker to wait for: workers would register through /instances."""
    return TestClient(create_app(ProxyConfig(encode_urls=(), decode_urls=(), dynamic_registration=True,
                                             internal_key=INTERNAL_KEY, api_key=api_key)))


@pytest.fixture
def keyed() -> Iterator[TestClient]:
    with proxy(API_KEY) as c:
        yield c


def test_the_openapi_document_needs_the_api_key_and_the_pages_are_off(keyed: TestClient) -> None:
    resp = keyed.get("/openapi.json")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert keyed.get("/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}).json()["openapi"]
    for page in ("/docs", "/redoc"):
        assert keyed.get(page).status_code == keyed.get(page, headers={"Authorization": f"Bearer {API_KEY}"}) \
            .status_code == 404


def test_without_an_api_key_the_document_and_pages_stay_open() -> None:
    with proxy(None) as c:
        assert c.get("/openapi.json").json()["openapi"] and c.get("/docs").status_code == 200


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive_for_both_keys(keyed: TestClient, scheme: str) -> None:
    assert keyed.get("/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
    assert keyed.get("/instances", headers={"Authorization": f"{scheme} {INTERNAL_KEY}"}).status_code == 200


@pytest.mark.parametrize("header", [f"Basic {API_KEY}", f"Bearer{API_KEY}", API_KEY, f"Bearer {API_KEY}x",
                                    f"Bearer {INTERNAL_KEY}", "Bearer "])
def test_anything_but_the_key_under_the_bearer_scheme_is_a_401(keyed: TestClient, header: str) -> None:
    assert keyed.get("/v1/models", headers={"Authorization": header}).status_code == 401


def test_head_health_and_ready_answer_like_get_without_a_body(keyed: TestClient) -> None:
    for path in ("/health", "/ready"):
        head, get = keyed.head(path), keyed.get(path)
        assert head.status_code == get.status_code and head.content == b""
    assert keyed.head("/health").status_code == 200
