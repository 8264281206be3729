"""LoRA adapters through the proxy app, with fake decoders behind it: a request whose `model` names an adapter goes
only to a decoder whose /health lists it, with `lora` set in its /generate body, and answers under the adapter's
name; /v1/models lists the adapters with their parent; a `model` that is neither the served model nor an adapter is
OpenAI's 404 model_not_found."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from proxy.app import create_app
from proxy.config import ProxyConfig
from tests.openai_schema import assert_valid
from tests.proxy.fake_decoder import FakeDecoder

ADAPTERS = {"loras": [{"name": "sql", "base_model_name": None, "rank": 8, "modules": 14}]}


@pytest.fixture
def stack() -> Iterator[tuple[TestClient, FakeDecoder, FakeDecoder]]:
    plain, with_lora = FakeDecoder(), FakeDecoder(health=ADAPTERS)
    cfg = ProxyConfig(encode_urls=(), decode_urls=(plain.url, with_lora.url), aggregated=True, startup_timeout=10.0,
                      health_interval=3600.0)
    client = TestClient(create_app(cfg))
    with client:
        yield client, plain, with_lora
    plain.close()
    with_lora.close()


def ask(client: TestClient, model: str) -> dict:
    resp = client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    return {"status": resp.status_code, **resp.json()}


def test_a_request_for_an_adapter_goes_to_a_decoder_holding_it(stack: tuple[TestClient, FakeDecoder,
                                                                            FakeDecoder]) -> None:
    client, plain, with_lora = stack
    for _ in range(4):
        answer = ask(client, "sql")
        assert answer["status"] == 200 and answer["model"] == "sql"
        assert_valid("CreateChatCompletionResponse", {k: v for k, v in answer.items() if k != "status"})
    assert plain.bodies == [] and [b["lora"] for b in with_lora.bodies] == ["sql"] * 4
    for _ in range(4):  # the base model goes to either, with no `lora`
        assert ask(client, "demo")["model"] == "demo"
    # the adapter's decoder busy past the load bound: the base model's requests go to the other one
    busy = client.app.state.proxy.started.workers.by_url[with_lora.url]  # type: ignore[attr-defined]
    busy.load += 5
    assert ask(client, "demo")["model"] == "demo"
    busy.load -= 5
    assert all("lora" not in b for b in plain.bodies + with_lora.bodies[4:]) and plain.bodies


def test_v1_models_lists_the_adapters_with_their_parent(stack: tuple[TestClient, FakeDecoder, FakeDecoder]) -> None:
    client = stack[0]
    data = client.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("demo", None), ("sql", "demo")]
    assert client.get("/v1/models/sql").json()["parent"] == "demo"


def test_an_unknown_model_is_a_404_naming_the_adapters(stack: tuple[TestClient, FakeDecoder, FakeDecoder]) -> None:
    answer = ask(stack[0], "nope")
    assert answer["status"] == 404 and answer["error"]["code"] == "model_not_found"
    assert "'sql'" in answer["error"]["message"] and stack[1].bodies == stack[2].bodies == []
    assert_valid("ErrorResponse", {"error": answer["error"]})
