"""The OpenAI features apps rely on, with the official `openai` client, through the EPD path and the aggregated path.

Both stacks serve the demo model; every check runs on both and the greedy answers must be the same (the split is
exact). Raw JSON answers are also validated against the official schemas (tests/openai_schema.py).
"""
from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from epd_models.demo import find_demo_model
from tests.e2e.stack import Stack, demo_png, launched
from tests.openai_schema import assert_valid

pytestmark = pytest.mark.e2e
MODES = ("epd", "aggregated")


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Stack]]:
    tmp = tmp_path_factory.mktemp("openai")
    with launched(tmp, "--model", "demo", "--num-encoders", "1", "--num-decoders", "1") as epd, \
            launched(tmp, "--model", "demo", "--aggregated", "--num-decoders", "1") as agg:
        yield {"epd": epd, "aggregated": agg}


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def image_message(colour: str, seed: int, question: str = "What color is the shape?") -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(demo_png(colour, seed, "square")).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": question}]}


def raw(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{stack.base_url}{path}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def raw_stream(stack: Stack, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{stack.base_url}{path}", json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def on_both(stacks: dict[str, Stack], ask: Any) -> list[Any]:
    """`ask(stack)` on both stacks; their answers must be equal (returned once, EPD's)."""
    answers = {mode: ask(stacks[mode]) for mode in MODES}
    assert answers["epd"] == answers["aggregated"], answers
    return [answers["epd"]]


def test_logprobs_are_the_sampled_distribution_streamed_or_not(stacks: dict[str, Stack]) -> None:
    body = {"model": "demo", "messages": [image_message("red", 1)], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}

    def ask(stack: Stack) -> list[tuple[str, float]]:
        answer = raw(stack, "/v1/chat/completions", body)
        assert_valid("CreateChatCompletionResponse", answer)
        content = answer["choices"][0]["logprobs"]["content"]
        text = answer["choices"][0]["message"]["content"]
        assert len(content) == answer["usage"]["completion_tokens"] - (answer["choices"][0]["finish_reason"] == "stop")
        assert b"".join(bytes(e["bytes"]) for e in content).decode() == text
        for e in content:  # greedy: the chosen token is the most likely one
            assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
            assert e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"]) and e["logprob"] <= 0
        chunks = raw_stream(stack, "/v1/chat/completions", body)
        for chunk in chunks:
            assert_valid("CreateChatCompletionStreamResponse", chunk)
        streamed = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
        assert streamed == content
        return [(e["token"], round(e["logprob"], 3)) for e in content]

    on_both(stacks, ask)


def test_n_choices_share_a_prompt_and_a_seed_reproduces_them(stacks: dict[str, Stack]) -> None:
    body = {"model": "demo", "messages": [image_message("blue", 2)], "max_tokens": 5, "n": 3, "seed": 7,
            "temperature": 1.0}

    def ask(stack: Stack) -> list[str]:
        first, again = (raw(stack, "/v1/chat/completions", body) for _ in range(2))
        assert_valid("CreateChatCompletionResponse", first)
        assert [c["index"] for c in first["choices"]] == [0, 1, 2]
        texts = [c["message"]["content"] for c in first["choices"]]
        assert texts == [c["message"]["content"] for c in again["choices"]]
        assert first["usage"]["completion_tokens"] <= 3 * 5
        streamed: dict[int, str] = {}
        for chunk in raw_stream(stack, "/v1/chat/completions", body):
            for ch in chunk["choices"]:
                streamed[ch["index"]] = streamed.get(ch["index"], "") + (ch["delta"].get("content") or "")
        assert [streamed[i] for i in range(3)] == texts
        return texts

    on_both(stacks, ask)


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}},
     "required": ["color", "sure"], "additionalProperties": False},
    {"type": "object", "properties": {"shape": {"type": "object", "properties": {
        "name": {"enum": ["circle", "square"]}, "sides": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["name", "sides"], "additionalProperties": False}}, "required": ["shape"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum-bool", "nested", "array"])
def test_json_schema_outputs_parse_and_validate(stacks: dict[str, Stack], schema: dict[str, Any]) -> None:
    def ask(stack: Stack) -> str:
        out = client(stack).chat.completions.create(
            model="demo", messages=[image_message("green", 3)], max_tokens=120, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                    "strict": True}})
        text = out.choices[0].message.content
        assert text is not None
        jsonschema.validate(json.loads(text), schema)
        return text

    on_both(stacks, ask)


def test_json_object_mode_answers_a_json_object(stacks: dict[str, Stack]) -> None:
    def ask(stack: Stack) -> str:
        out = client(stack).chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Describe the image."}], max_tokens=150,
            temperature=0, response_format={"type": "json_object"})
        text = out.choices[0].message.content or ""
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # a random-ish model may run out of tokens inside a string; it must still be a JSON prefix
            assert text.lstrip().startswith("{")
        return text

    on_both(stacks, ask)


TOOLS = [{"type": "function", "function": {"name": "report_color", "description": "Report the shape's color.",
                                           "parameters": {"type": "object", "properties": {
                                               "color": {"enum": ["red", "green", "blue"]}},
                                               "required": ["color"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "count", "parameters": {
             "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["n"], "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_parse_and_match_the_function_schema(stacks: dict[str, Stack], choice: str) -> None:
    tool_choice: Any = "required" if choice == "required" else {"type": "function",
                                                                 "function": {"name": "report_color"}}
    body = {"model": "demo", "messages": [image_message("red", 4)], "max_tokens": 80, "temperature": 0,
            "tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}

    def ask(stack: Stack) -> list[tuple[str, str]]:
        answer = raw(stack, "/v1/chat/completions", body)
        assert_valid("CreateChatCompletionResponse", answer)
        choice0 = answer["choices"][0]
        assert choice0["finish_reason"] == "tool_calls"
        calls = choice0["message"]["tool_calls"]
        assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"]
        fn = calls[0]["function"]
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        assert fn["name"] in params and (choice == "required" or fn["name"] == "report_color")
        jsonschema.validate(json.loads(fn["arguments"]), params[fn["name"]])
        streamed: dict[int, dict[str, str]] = {}
        for chunk in raw_stream(stack, "/v1/chat/completions", body):
            assert_valid("CreateChatCompletionStreamResponse", chunk)
            for ch in chunk["choices"]:
                for d in ch["delta"].get("tool_calls") or []:
                    call = streamed.setdefault(d["index"], {"name": "", "arguments": ""})
                    call["name"] += (d.get("function") or {}).get("name") or ""
                    call["arguments"] += (d.get("function") or {}).get("arguments") or ""
        assert streamed == {0: {"name": fn["name"], "arguments": fn["arguments"]}}
        return [(fn["name"], fn["arguments"])]

    on_both(stacks, ask)


def test_tool_history_and_choice_none(stacks: dict[str, Stack]) -> None:
    """A conversation carrying an assistant tool call and its result renders; `none` never answers with a call."""
    history = [image_message("blue", 5),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "report_color", "arguments": "{\"color\": \"blue\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "noted"}]

    def ask(stack: Stack) -> str | None:
        out = client(stack).chat.completions.create(model="demo", messages=history, max_tokens=6,
                                                    temperature=0, tools=TOOLS, tool_choice="none")
        assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
        return out.choices[0].message.content

    on_both(stacks, ask)


def test_completions_strings_token_ids_streaming_logprobs_and_echo(stacks: dict[str, Stack]) -> None:
    def ask(stack: Stack) -> tuple[str, ...]:
        c = client(stack)
        text = c.completions.create(model="demo", prompt="The shape is a", max_tokens=5, temperature=0)
        answer = raw(stack, "/v1/completions", {"model": "demo", "prompt": "The shape is a", "max_tokens": 5,
                                                "temperature": 0, "logprobs": 2})
        assert_valid("CreateCompletionResponse", answer)
        assert answer["choices"][0]["text"] == text.choices[0].text
        lp = answer["choices"][0]["logprobs"]
        assert "".join(lp["tokens"]) == text.choices[0].text or len(lp["tokens"]) == answer["usage"][
            "completion_tokens"]
        assert all(len(top) <= 2 for top in lp["top_logprobs"])
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="demo", prompt="The shape is a", max_tokens=5, temperature=0, stream=True))
        assert streamed == text.choices[0].text
        echoed = c.completions.create(model="demo", prompt="The shape is a", max_tokens=5, temperature=0, echo=True)
        assert echoed.choices[0].text == "The shape is a" + text.choices[0].text
        ids = c.completions.create(model="demo", prompt=[10, 20, 30], max_tokens=3, temperature=0)
        assert ids.usage is not None and ids.usage.prompt_tokens == 3
        return text.choices[0].text, ids.choices[0].text

    on_both(stacks, ask)


def test_models_retrieve_and_cached_tokens(stacks: dict[str, Stack]) -> None:
    def ask(stack: Stack) -> tuple[int, int]:
        c = client(stack)
        assert c.models.retrieve("demo").id == "demo"
        msg = image_message("purple", 6)
        first = raw(stack, "/v1/chat/completions", {"model": "demo", "messages": [msg], "max_tokens": 2})
        second = raw(stack, "/v1/chat/completions", {"model": "demo", "messages": [msg], "max_tokens": 2})
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second)]
        assert cached[0] == 0 and 0 < cached[1] < second["usage"]["prompt_tokens"]
        return cached[0], cached[1]

    on_both(stacks, ask)
    missing = httpx.get(f"{stacks['epd'].base_url}/v1/models/nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_logit_bias_min_p_and_stop_token_ids_change_the_output(stacks: dict[str, Stack]) -> None:
    def ask(stack: Stack) -> str:
        base = {"model": "demo", "messages": [image_message("yellow", 7)], "max_tokens": 4, "temperature": 0,
                "logprobs": True}
        plain = raw(stack, "/v1/chat/completions", base)
        first = plain["choices"][0]["logprobs"]["content"][0]
        # the greedy first token, banned: the answer starts with the runner-up instead
        banned_id = _token_id(first["token"])
        biased = raw(stack, "/v1/chat/completions", {**base, "logit_bias": {str(banned_id): -100}})
        assert biased["choices"][0]["logprobs"]["content"][0]["token"] != first["token"]
        stopped = raw(stack, "/v1/chat/completions", {**base, "stop_token_ids": [banned_id]})
        assert stopped["choices"][0]["message"]["content"] == "" and stopped["usage"]["completion_tokens"] == 1
        kept = raw(stack, "/v1/chat/completions", {**base, "temperature": 1.0, "min_p": 1.0, "seed": 3})
        assert kept["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]  # min_p=1: greedy
        return str(biased["choices"][0]["message"]["content"])

    on_both(stacks, ask)


def _token_id(token: str) -> int:
    """The id of a token's text in the demo model's tokenizer."""
    tok = AutoTokenizer.from_pretrained(find_demo_model())
    ids = tok(token, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (token, ids)
    return int(ids[0])


def test_a_schema_the_grammar_cannot_compile_is_a_400_naming_it(stacks: dict[str, Stack]) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}
    for stack in stacks.values():
        resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "response_format" and "nonsense" in error["message"]
        assert_valid("ErrorResponse", resp.json())
