"""--api-key: /v1/* needs `Authorization: Bearer <key>`; a missing or wrong key is a 401 OpenAI error."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from epd_common.errors import install_error_handlers
from epd_common.http import install_api_key
from tests.openai_schema import assert_valid


def client(key: str | None) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    install_api_key(app, key)

    @app.get("/v1/models")
    async def models() -> dict[str, str]:
        return {"object": "list"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return TestClient(app)


def test_missing_or_wrong_key_is_401_and_the_right_key_passes() -> None:
    c = client("s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        resp = c.get("/v1/models", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert_valid("ErrorResponse", resp.json())
    assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_health_stays_open_and_no_key_means_no_check() -> None:
    assert client("s3cret").get("/health").status_code == 200
    assert client(None).get("/v1/models").status_code == 200
