"""A lone UTF-16 surrogate ("\\ud800" in JSON) in any text field is a 400 naming the field, never a 500; and every
answer of the completions endpoints, a 500 from an unexpected exception included, is counted by status. The proxy app in process, in front of a fake decoder (tests/proxy/fake_decoder.py)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.state import ProxyState
from tests.e2e.stack import metric
from tests.proxy.fake_decoder import FakeDecoder

LONE = "\ud800"  # json.dumps writes it as the escape "\ud800", which json.loads reads back alone
LOW = "\udc00"  # a lone low (trailing) surrogate
REVERSED = "\udc00\ud800"  # a low then a high: two lone surrogates, not a pair
SCHEMA = {"type": "object", "properties": {"x": {"type": "string", "description": "d"}}}
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": SCHEMA}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def with_call(arguments: str = "{}", answer: str = "ok") -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "f",
                                                                                         "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": answer}]


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


# (fields of a chat body, the param the 400 names)
CHAT_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "content string": ({"messages": user(f"a{LONE}b")}, "messages.0.content"),
    "text part": ({"messages": user([{"type": "text", "text": f"a{LONE}"}])}, "messages.0.content.0.text"),
    "system": ({"messages": [{"role": "system", "content": LONE}, *user("hi")]}, "messages.0.content"),
    "tool message": ({"messages": with_call(answer=f"x{LONE}")}, "messages.2.content"),
    "tool-call arguments": ({"messages": with_call(arguments=f'{{"a": "{LONE}"}}')},
                            "messages.1.tool_calls.0.function.arguments"),
    "tool description": ({"tools": [{**TOOL, "function": {**TOOL["function"], "description": LONE}}]},
                         "tools.0.function.description"),
    "tool schema value": ({"tools": [{**TOOL, "function": {**TOOL["function"], "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "description": LONE}}}}}]},
        "tools.0.function.parameters.properties.x.description"),
    "tool schema key": ({"tools": [{**TOOL, "function": {**TOOL["function"], "parameters": {
        "type": "object", "properties": {LONE: {"type": "string"}}}}}]}, "tools.0.function.parameters.properties"),
    "response_format value": ({"response_format": schema_format({"type": "string", "enum": [LONE]})},
                              "response_format.json_schema.schema.enum.0"),
    "response_format key": ({"response_format": schema_format({"type": "object", "properties": {LONE: {}}})},
                            "response_format.json_schema.schema.properties"),
    "stop string": ({"stop": LONE}, "stop"),
    "stop list": ({"stop": ["ok", LONE]}, "stop.1"),
    "cache_salt": ({"cache_salt": LONE}, "cache_salt"),
    "unknown field": ({"whatever": LONE}, "whatever"),
}
COMPLETION_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "prompt": ({"prompt": f"Once {LONE}"}, "prompt"),
    "prompt list": ({"prompt": [f"Once {LONE}"]}, "prompt.0"),
    "stop": ({"prompt": "Once", "stop": [LONE]}, "stop.0"),
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    decoder = FakeDecoder()
    cfg = ProxyConfig(encode_urls=(), decode_urls=(decoder.url,), aggregated=True, startup_timeout=10.0)
    try:
        with TestClient(create_app(cfg), raise_server_exceptions=False) as c:
            yield c
    finally:
        decoder.close()


def post(client: TestClient, path: str, body: dict[str, Any], escape: str = "\\ud800") -> Any:
    raw = json.dumps(body)  # ensure_ascii: the lone surrogate travels as its \\ud800 escape, as a client sends it
    assert escape in raw
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def counted(client: TestClient, status: int, path: str = "/v1/chat/completions") -> float:
    return metric(client.get("/metrics").text, f'epd_proxy_requests_total{{endpoint="{path}",status="{status}"}}')


def refused(client: TestClient, path: str, body: dict[str, Any], param: str, escape: str = "\\ud800") -> None:
    before = counted(client, 400, path)
    resp = post(client, path, body, escape)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_request" and "surrogate" in error["message"]
    assert counted(client, 400, path) == before + 1


@pytest.mark.parametrize("stream", [False, True], ids=["chat", "streaming"])
@pytest.mark.parametrize("case", CHAT_CASES)
def test_a_lone_surrogate_in_a_chat_field_is_a_400_naming_it(client: TestClient, case: str, stream: bool) -> None:
    fields, param = CHAT_CASES[case]
    body = {"model": "demo", "messages": user("hi"), "max_tokens": 2, "stream": stream, **fields}
    refused(client, "/v1/chat/completions", body, param)


@pytest.mark.parametrize("stream", [False, True], ids=["completions", "streaming"])
@pytest.mark.parametrize("case", COMPLETION_CASES)
def test_a_lone_surrogate_in_a_completions_field_is_a_400_naming_it(client: TestClient, case: str,
                                                                   stream: bool) -> None:
    fields, param = COMPLETION_CASES[case]
    refused(client, "/v1/completions", {"model": "demo", "max_tokens": 2, "stream": stream, **fields}, param)


@pytest.mark.parametrize("text", [LOW, f"a{LOW}b", REVERSED, f"a{REVERSED}b"],
                         ids=["low", "low inside", "reversed pair", "reversed pair inside"])
def test_a_lone_low_surrogate_or_a_reversed_pair_is_a_400_in_a_value_and_in_a_key(client: TestClient,
                                                                                 text: str) -> None:
    """The whole surrogate range is refused, not only high surrogates: "a\\udc00b" and "\\udc00\\ud800" (a low
    before a high pairs nothing) in a value and in an object key."""
    in_value = {"messages": user(text)}
    in_key = {"response_format": schema_format({"type": "object", "properties": {text: {}}})}
    for fields, param in [(in_value, "messages.0.content"), (in_key, "response_format.json_schema.schema.properties")]:
        body = {"model": "demo", "messages": user("hi"), "max_tokens": 2, **fields}
        refused(client, "/v1/chat/completions", body, param, escape="\\udc00")


def test_a_valid_surrogate_pair_is_text_like_any_other(client: TestClient) -> None:
    body = {"model": "demo", "messages": user("a \U0001F600 b"), "max_tokens": 2}  # json.dumps: "\ud83d\ude00"
    resp = client.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text


def test_an_unexpected_exception_is_a_500_counted_by_status(client: TestClient,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self: ProxyState, req: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(ProxyState, "prepare", broken)
    before = counted(client, 500)
    resp = client.post("/v1/chat/completions", json={"model": "demo", "messages": user("hi"), "max_tokens": 2})
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "internal_error"
    assert counted(client, 500) == before + 1
