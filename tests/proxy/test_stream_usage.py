"""A streamed answer is counted like a collected one: the proxy's token counters (epd_proxy_prompt_tokens,
epd_proxy_generation_tokens) rise by the true usage of a stream=True request (stream_options.include_usage), the
same as for the request not streamed, and the usage chunk says the same numbers. The proxy app in process in front
of the fake decoder, whose every choice takes PROMPT_TOKENS and generates 3 tokens."""
from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.e2e.stack import metric
from tests.proxy.fake_decoder import PROMPT_TOKENS

COUNTERS = ("epd_proxy_prompt_tokens_total", "epd_proxy_generation_tokens_total")
BODIES = {
    "/v1/chat/completions": {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"model": "demo", "prompt": "Once", "max_tokens": 3},
}


def counters(http: TestClient) -> tuple[float, float]:
    text = http.get("/metrics").text
    prompt, generated = (metric(text, name) for name in COUNTERS)
    return prompt, generated


def streamed_usage(http: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The usage chunk of a streamed answer (read to its [DONE])."""
    with http.stream("POST", path, json={**body, "stream": True,
                                         "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        frames = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all("error" not in c for c in chunks), chunks
    usage = chunks[-1]["usage"]
    assert isinstance(usage, dict) and not chunks[-1]["choices"]
    return usage


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("path", BODIES)
def test_a_streamed_answer_counts_its_prompt_and_generated_tokens(http: TestClient, path: str, n: int) -> None:
    body = {**BODIES[path], "n": n}
    before = counters(http)
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    collected = resp.json()["usage"]
    after_collected = counters(http)
    usage = streamed_usage(http, path, body)
    after_streamed = counters(http)
    truth = (PROMPT_TOKENS, 3 * n)  # the prompt once, every choice's tokens
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == truth
    assert (collected["prompt_tokens"], collected["completion_tokens"]) == truth
    assert (after_collected[0] - before[0], after_collected[1] - before[1]) == truth
    assert (after_streamed[0] - after_collected[0], after_streamed[1] - after_collected[1]) == truth


@pytest.mark.parametrize("path", BODIES)
def test_a_stream_without_the_usage_chunk_is_counted_too(http: TestClient, path: str) -> None:
    before = counters(http)
    with http.stream("POST", path, json={**BODIES[path], "stream": True}) as resp:
        assert resp.status_code == 200
        frames = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    assert not any(json.loads(f).get("usage") for f in frames[:-1])  # no usage chunk was asked for
    after = counters(http)
    assert (after[0] - before[0], after[1] - before[1]) == (PROMPT_TOKENS, 3)
