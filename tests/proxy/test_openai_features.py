"""The chat-completions features apps use, through the official `openai` client, the proxy app and a fake decoder
speaking the NDJSON contract: logprobs, n choices, tool calls, structured outputs, the vLLM sampling extensions,
cached tokens, image detail, model retrieval, and a 400 naming the parameter for everything out of range or
still not implemented. Every answer is validated against the official schemas."""
from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import msgspec
import openai
import pytest
from fastapi.testclient import TestClient

from epd_contracts.generate import MAX_SCHEMA_BYTES, MAX_TOOLS, ToolChoice
from epd_contracts.hashing import mm_hash
from proxy.generation import Generation
from tests.factories import make_image
from tests.openai_schema import assert_valid
from tests.proxy.fake_decoder import PROMPT_TOKENS, FakeDecoder, words
from tests.proxy.test_generation import CHAT, FakeFleet, FakeStream

USER = [{"role": "user", "content": "What is the weather?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def chat(api: openai.OpenAI, messages: list[Any] = USER, **kw: Any) -> dict[str, Any]:
    """A non-streamed answer as JSON, validated against the official schema."""
    raw = api.chat.completions.with_raw_response.create(model="demo", messages=messages, **kw)
    body: dict[str, Any] = raw.http_response.json()
    assert_valid("CreateChatCompletionResponse", body)
    return body


def stream(api: openai.OpenAI, **kw: Any) -> list[dict[str, Any]]:
    """A streamed answer's chunks as JSON, each validated against the official schema."""
    answer: Any = api.chat.completions.create(model="demo", messages=USER, stream=True, **kw)  # type: ignore[arg-type]
    chunks = [c.model_dump(exclude_unset=True) for c in answer]
    for c in chunks:
        assert_valid("CreateChatCompletionStreamResponse", c)
    return chunks


def reassemble(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Streamed deltas per choice index: role, content, logprobs, tool calls (by call index), finish reason."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            got = out.setdefault(ch["index"], {"role": None, "content": "", "logprobs": [], "calls": {}, "finish": None})
            delta = ch["delta"]
            got["role"] = got["role"] or delta.get("role")
            got["content"] += delta.get("content") or ""
            got["logprobs"] += (ch.get("logprobs") or {}).get("content") or []
            for call in delta.get("tool_calls") or []:
                into = got["calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                into["id"] = into["id"] or call.get("id")
                into["name"] += call.get("function", {}).get("name") or ""
                into["arguments"] += call.get("function", {}).get("arguments") or ""
            got["finish"] = got["finish"] or ch.get("finish_reason")
    return out


def test_logprobs_streamed_and_not_have_openais_shape_and_agree(api: openai.OpenAI, decoder: FakeDecoder) -> None:
    body = chat(api, logprobs=True, top_logprobs=2)
    assert decoder.bodies[-1]["sampling"]["logprobs"] == 2
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == words(0) and body["choices"][0]["logprobs"]["refusal"] is None
    for e in content:
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
        assert bytes(e["bytes"]).decode() == e["token"]
    streamed = reassemble(stream(api, logprobs=True, top_logprobs=2))
    assert streamed[0]["logprobs"] == content
    assert chat(api)["choices"][0]["logprobs"] is None and "logprobs" not in decoder.bodies[-1]["sampling"]
    chat(api, logprobs=True)
    assert decoder.bodies[-1]["sampling"]["logprobs"] == 0


def test_n_choices_stream_by_index_and_reassemble_to_the_non_streamed_answer(api: openai.OpenAI,
                                                                           decoder: FakeDecoder) -> None:
    body = chat(api, n=3)
    assert decoder.bodies[-1]["sampling"]["n"] == 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["".join(words(i)) for i in range(3)]
    assert body["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 9, "total_tokens": PROMPT_TOKENS + 9,
                             "prompt_tokens_details": {"cached_tokens": decoder.cached_tokens}}
    chunks = stream(api, n=3, stream_options={"include_usage": True})
    streamed = reassemble(chunks)
    assert sorted(streamed) == [0, 1, 2]
    for c in body["choices"]:
        got = streamed[c["index"]]
        assert (got["role"], got["content"], got["finish"]) == ("assistant", c["message"]["content"], c["finish_reason"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_streamed_deltas_reassemble_to_the_message(api: openai.OpenAI, decoder: FakeDecoder,
                                                             choice: Any) -> None:
    body = chat(api, tools=[TOOL], tool_choice=choice, parallel_tool_calls=False)
    sent = decoder.bodies[-1]
    assert sent["tools"] == [TOOL]
    mode: Any = choice if isinstance(choice, str) else "function"
    assert msgspec.convert(sent["tool_choice"], ToolChoice) == \
        ToolChoice(mode=mode, name="get_weather" if mode == "function" else "", parallel=False)
    (only,) = body["choices"]
    assert only["finish_reason"] == "tool_calls" and only["message"]["content"] is None
    (call,) = only["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "P0"}
    streamed = reassemble(stream(api, tools=[TOOL], tool_choice=choice))[0]
    assert streamed["finish"] == "tool_calls"
    assert streamed["calls"] == {0: {"id": call["id"], **call["function"]}}


def test_tool_choice_none_answers_in_text_and_tool_history_reaches_the_decoder(api: openai.OpenAI,
                                                                              decoder: FakeDecoder) -> None:
    history: list[Any] = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = chat(api, messages=history, tools=[TOOL], tool_choice="none")
    assert body["choices"][0]["message"]["content"] == "".join(words(0))
    sent = decoder.bodies[-1]["messages"]
    assert sent[1]["tool_calls"] == history[1]["tool_calls"] and sent[1]["content"] == ""
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_response_format_and_sampling_extensions_reach_the_decoder(api: openai.OpenAI, decoder: FakeDecoder) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat(api, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
         logit_bias={"5": -100, "7": 2.5}, extra_body={"min_p": 0.2, "stop_token_ids": [3, 4]})
    sent = decoder.bodies[-1]
    assert sent["response_format"] == {"type": "json_schema", "json_schema": schema, "strict": True}
    assert sent["sampling"]["logit_bias"] == {"5": -100.0, "7": 2.5}
    assert sent["sampling"]["min_p"] == 0.2 and sent["sampling"]["stop_token_ids"] == [3, 4]
    chat(api, response_format={"type": "json_object"})
    assert decoder.bodies[-1]["response_format"] == {"type": "json_object"}
    chat(api, response_format={"type": "text"})
    assert "response_format" not in decoder.bodies[-1]


def test_image_detail_reaches_the_decoder_and_the_hash(api: openai.OpenAI, decoder: FakeDecoder) -> None:
    buf = io.BytesIO()
    make_image(32, 32).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url, "detail": d}} for d in ("low", "high")]
    chat(api, messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}])
    low, high = decoder.bodies[-1]["images"]
    assert (low["detail"], low["mm_hash"]) == ("low", mm_hash(buf.getvalue(), "low"))
    assert high["mm_hash"] == mm_hash(buf.getvalue()) != low["mm_hash"]


def test_models_retrieve_gives_the_card_or_model_not_found(api: openai.OpenAI, http: TestClient) -> None:
    card = http.get("/v1/models/demo").json()
    assert_valid("Model", card)
    assert api.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError) as err:
        api.models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found"
    assert_valid("ErrorResponse", err.value.response.json())


BIG = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
REFUSED = [
    ({"top_logprobs": 2}, "top_logprobs", "invalid_request"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_request"),
    ({"n": 0}, "n", "invalid_request"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG}}}, "response_format",
     "invalid_request"),
    ({"response_format": {"type": "xml"}}, "response_format", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "invalid_request"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters",
     "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BIG}}]}, "tools.0.function.parameters",
     "invalid_request"),
    ({"tools": [TOOL] * (MAX_TOOLS + 1)}, "tools", "invalid_request"),
    ({"tool_choice": "auto"}, "tool_choice", "invalid_request"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice",
     "invalid_request"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "invalid_request"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_request"),
    ({"min_p": 2}, "min_p", "invalid_request"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0", "invalid_request"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "y", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.1.tool_calls",
     "invalid_value"),
    # still not implemented
    *[({field: value}, field, "unsupported_parameter") for field, value in [
        ("audio", {"voice": "alloy", "format": "wav"}), ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}), ("best_of", 2), ("use_beam_search", True), ("repetition_penalty", 1.3),
        ("min_tokens", 3), ("bad_words", ["x"]), ("guided_json", {"type": "object"}), ("functions", [{"name": "f"}]),
        ("echo", True), ("modalities", ["audio"]), ("reasoning_effort", "high")]],
]


@pytest.mark.parametrize("fields,param,code", REFUSED)
def test_out_of_range_or_unimplemented_fields_are_a_400_naming_them(http: TestClient, decoder: FakeDecoder,
                                                                   fields: dict[str, Any], param: str, code: str) -> None:
    resp = http.post("/v1/chat/completions", json={"model": "demo", "messages": USER, **fields})
    assert resp.status_code == 400, resp.text
    assert_valid("ErrorResponse", resp.json())
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (param, code), resp.text
    assert not decoder.bodies


def test_items_the_scheduler_skipped_go_to_the_decoder_as_cached() -> None:
    fleet = FakeFleet({"d0": [FakeStream([])]})
    gen = Generation(fleet, CHAT, "rid")  # type: ignore[arg-type]
    asyncio.run(gen.open({"a": "tcp://e0", "b": "tcp://e1"}, cached=frozenset({"a"})))
    images = fleet.opened[-1][1]["images"]
    assert [im.get("cached", False) for im in images] == [True, False]
