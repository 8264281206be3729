"""Schemas that compile but cannot finish, and the compile-cost attack, through a real stack.

Before, a `$ref` that requires itself, or a property named like a special token with a `const` of special tokens,
streamed a few tokens and then failed with 502 `generation_failed`. What can be seen before decoding is refused
then (the proxy first where it needs no tokenizer, the decoder again); a dead end reached while decoding ends the
request with a 400-class error naming the schema (an error event when streaming), never a 502.
"""
from __future__ import annotations

import json
from typing import Any

import httpx

from tests.hostile.stack import HostileStack, run_victims

HOSTILE = {"type": "object", "patternProperties": {f"^tag{i}(a|b)*c$": {"type": "string"} for i in range(300)}}
SELF_REQUIRED = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                      "required": ["x"]}}}
SPECIAL_LITERAL = {"type": "object", "properties": {"<|endoftext|>": {"const": "<|endoftext|><|im_end|>"}},
                   "required": ["<|endoftext|>"]}
# passes every check made before decoding; the library then forces the special token and refuses it
PEAK_RSS_GROWTH_BOUND = 64 << 20  # each process's peak RSS growth while the attacks run (measured: encoder 14 MiB for the victims' new images, decoder and proxy under 2 MiB)
SPECIAL_PATTERN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^<\\|im_end\\|>$"}},
                   "required": ["a"]}


def chat(schema: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "Describe the shape."}], "max_tokens": 40,
            "temperature": 0, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}


def post(stack: HostileStack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)


def error_of(resp: httpx.Response) -> tuple[int, str, str]:
    error = resp.json()["error"]
    return resp.status_code, error["code"], error["param"]


def sse_error(resp: httpx.Response) -> dict[str, Any]:
    """The error event of an SSE stream (which must end with [DONE])."""
    lines = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", resp.text
    errors = [json.loads(ln)["error"] for ln in lines[:-1] if "error" in json.loads(ln)]
    assert len(errors) == 1, resp.text
    return dict(errors[0])


def test_the_compile_cost_attack_is_refused_by_the_proxy(stack: HostileStack) -> None:
    assert error_of(post(stack, chat(HOSTILE))) == (400, "schema_too_complex", "response_format")
    tools = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": HOSTILE}}]}
    assert error_of(post(stack, tools)) == (400, "schema_too_complex", "tools.0.function.parameters")


def test_a_schema_that_requires_itself_is_a_400_before_any_token(stack: HostileStack) -> None:
    for stream in (False, True):
        assert error_of(post(stack, chat(SELF_REQUIRED, stream))) == (400, "unsatisfiable_schema", "response_format")
    direct = httpx.post(f"{stack.urls['decoder']}/generate", timeout=120,  # the decoder holds it again
                        headers={"Authorization": f"Bearer {stack.internal_key}"},
                        json={"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": SELF_REQUIRED}})
    assert error_of(direct) == (400, "unsatisfiable_schema", "response_format")


def test_a_special_token_literal_is_refused_by_the_decoder_before_any_token(stack: HostileStack) -> None:
    for stream in (False, True):
        assert error_of(post(stack, chat(SPECIAL_LITERAL, stream))) == (400, "unsatisfiable_schema",
                                                                         "response_format")


def test_a_dead_end_while_decoding_is_the_requests_400_not_a_502(stack: HostileStack) -> None:
    code, kind, param = error_of(post(stack, chat(SPECIAL_PATTERN)))
    assert (code, kind, param) == (400, "unsatisfiable_schema", "response_format")
    streamed = post(stack, chat(SPECIAL_PATTERN, stream=True))
    assert streamed.status_code == 200
    error = sse_error(streamed)
    assert (error["code"], error["param"], error["type"]) == ("unsatisfiable_schema", "response_format",
                                                              "invalid_request_error")


def test_other_users_streams_are_unchanged_while_dead_ends_happen(stack: HostileStack) -> None:
    def attack() -> list[int]:
        return [post(stack, chat(s, stream)).status_code for s in (SPECIAL_PATTERN, SELF_REQUIRED, HOSTILE)
                for stream in (False, True)]

    peak_before = stack.peak_rss()
    run = run_victims(stack.base_url, n=2, during=attack)
    run.assert_undisturbed()
    growth = {role: peak - peak_before[role] for role, peak in stack.peak_rss().items()}
    assert all(g <= PEAK_RSS_GROWTH_BOUND for g in growth.values()), f"peak RSS growth (bytes): {growth}"
    assert run.during == [400, 200, 400, 400, 400, 400]  # the streamed dead end: 200, then its error event
    assert not stack.dead()
