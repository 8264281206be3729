"""Validation errors leave as OpenAI error JSON naming the bad parameter, never FastAPI's {"detail": ...}."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from epd_common.errors import install_error_handlers
from proxy.protocol import ChatCompletionRequest
from tests.openai_schema import assert_valid


def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> dict[str, str]:
        req.sampling()  # sampling fields are checked by the contract, as the proxy's prepare_chat does
        return {"ok": req.model}

    return TestClient(app)


def user(content: object) -> dict[str, object]:
    return {"model": "demo", "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("body,param,words", [
    (user([{"type": "file"}]), "messages.0.content.0", "does not match any of the expected tags"),
    (user([{"type": "input_audio"}]), "messages.0.content.0.input_audio", "Field required"),
    (user([{"type": "image_url", "image_url": {}}]), "messages.0.content.0.image_url.url", "Field required"),
    ({"model": "demo", "messages": []}, "messages", "at least 1 item"),
    ({**user("hi"), "temperature": 5}, "temperature", "<= 2"),
    ({**user("hi"), "n": 129}, "n", "less than or equal to 128"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model", "Field required"),
])
def test_invalid_request_names_the_parameter(body: dict[str, object], param: str, words: str) -> None:
    resp = client().post("/v1/chat/completions", json=body)
    assert resp.status_code == 400 and "detail" not in resp.json()
    assert_valid("ErrorResponse", resp.json())
    assert resp.json()["error"]["param"] == param and words in resp.json()["error"]["message"]


def test_body_that_is_not_json_is_400() -> None:
    resp = client().post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "request body is not valid JSON"
