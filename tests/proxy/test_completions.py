"""/v1/completions through the official `openai` client, the proxy app and a fake decoder: string and token-id
prompts, streaming, n, the legacy logprobs, echo, and a 400 naming each field it does not serve."""
from __future__ import annotations

from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from tests.openai_schema import assert_valid
from tests.proxy.fake_decoder import FakeDecoder, words


def complete(api: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = api.completions.with_raw_response.create(model="demo", **kw).http_response.json()
    assert_valid("CreateCompletionResponse", body)
    return body


def stream(api: openai.OpenAI, **kw: Any) -> list[dict[str, Any]]:
    chunks = [c.model_dump(exclude_unset=True) for c in api.completions.create(model="demo", stream=True, **kw)]
    for c in chunks:  # the schema's finish_reason has no null (OpenAI streams null until a choice ends)
        assert_valid("CreateCompletionResponse", {**c, "choices": [{**ch, "finish_reason": ch["finish_reason"] or "stop"}
                                                                  for ch in c["choices"]]})
    return chunks


@pytest.mark.parametrize("prompt,sent", [("Once upon", "Once upon"), ([1, 2, 3], [1, 2, 3]), (["Once"], "Once"),
                                         ([[4, 5]], [4, 5])])
def test_one_prompt_as_text_or_token_ids(api: openai.OpenAI, decoder: FakeDecoder, prompt: Any, sent: Any) -> None:
    body = complete(api, prompt=prompt)
    assert decoder.bodies[-1]["prompt"] == sent and "messages" not in decoder.bodies[-1]
    assert decoder.bodies[-1]["sampling"]["max_tokens"] == 16  # OpenAI's default
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "".join(words(0))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": decoder.cached_tokens}


def test_streamed_choices_reassemble_to_the_answer(api: openai.OpenAI, decoder: FakeDecoder) -> None:
    body = complete(api, prompt="x", n=2, max_tokens=3)
    chunks = stream(api, prompt="x", n=2, max_tokens=3, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            finish[ch["index"]] = finish.get(ch["index"]) or ch["finish_reason"]
    assert [texts[i] for i in range(2)] == [c["text"] for c in body["choices"]]
    assert [finish[i] for i in range(2)] == [c["finish_reason"] for c in body["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


def test_legacy_logprobs_streamed_and_not(api: openai.OpenAI, decoder: FakeDecoder) -> None:
    lp = complete(api, prompt="x", logprobs=2)["choices"][0]["logprobs"]
    assert decoder.bodies[-1]["sampling"]["logprobs"] == 2
    assert lp["tokens"] == words(0) and len(lp["token_logprobs"]) == 3
    assert all(len(top) == 2 and max(top, key=top.get) == tok for top, tok in zip(lp["top_logprobs"], lp["tokens"],
                                                                                  strict=True))
    assert lp["text_offset"] == [sum(len(t) for t in words(0)[:i]) for i in range(3)]
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in stream(api, prompt="x", logprobs=2):
        for key, values in ((c["choices"] or [{}])[0].get("logprobs") or {}).items():
            merged[key] += values
    assert merged == lp


def test_echo_puts_the_prompt_first(api: openai.OpenAI, decoder: FakeDecoder) -> None:
    body = complete(api, prompt="Once", echo=True)
    assert decoder.bodies[-1]["echo"] is True and body["choices"][0]["text"].startswith("Once")


@pytest.mark.parametrize("fields,param", [
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [[1], [2]]}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"), ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"), ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 2}, "best_of"), ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": [-1]}, "prompt"), ({"prompt": "x", "model": "other"}, "model"),
])
def test_what_completions_does_not_serve_is_a_4xx_naming_it(http: TestClient, decoder: FakeDecoder,
                                                            fields: dict[str, Any], param: str) -> None:
    resp = http.post("/v1/completions", json={"model": "demo", **fields})
    assert resp.status_code in (400, 404), resp.text
    assert_valid("ErrorResponse", resp.json())
    assert param in (resp.json()["error"]["param"] or ""), resp.text
    assert not decoder.bodies
