"""vLLM's cache_salt on chat and completions requests: a non-empty string of at most 256 characters, passed to the
decoder with the request's prefix keys; anything else is a 400 naming it."""
from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from epd_contracts.generate import MAX_CACHE_SALT_CHARS
from tests.proxy.fake_decoder import FakeDecoder

CHAT = {"model": "demo", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
TEXT = {"model": "demo", "prompt": "Once upon a time"}


@pytest.mark.parametrize("request_body", [CHAT, TEXT], ids=["chat", "completions"])
def test_a_bad_cache_salt_is_a_400_naming_it(http: TestClient, decoder: FakeDecoder,
                                             request_body: dict[str, Any]) -> None:
    path = "/v1/chat/completions" if "messages" in request_body else "/v1/completions"
    for salt in ("", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, ["a"], {"a": 1}):
        resp = http.post(path, json={**request_body, "cache_salt": salt})
        assert resp.status_code == 400, salt
        error = resp.json()["error"]
        assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"
        assert "cache_salt" in error["message"]
    assert not decoder.bodies


@pytest.mark.parametrize("request_body", [CHAT, TEXT], ids=["chat", "completions"])
def test_the_salt_and_the_prefix_keys_reach_the_decoder(http: TestClient, decoder: FakeDecoder,
                                                        request_body: dict[str, Any]) -> None:
    path = "/v1/chat/completions" if "messages" in request_body else "/v1/completions"
    longest = "s" * MAX_CACHE_SALT_CHARS
    for salt in (None, "tenant-a", longest):
        assert http.post(path, json={**request_body, **({"cache_salt": salt} if salt else {})}).status_code == 200
    plain, salted, long_salt = decoder.bodies
    assert "cache_salt" not in plain and salted["cache_salt"] == "tenant-a" and long_salt["cache_salt"] == longest
    num_keys = len(request_body.get("messages", [1]))
    assert all(len(b["prefix_keys"]) == num_keys for b in decoder.bodies)
    assert not set(plain["prefix_keys"]) & set(salted["prefix_keys"])
