"""One tenant learns nothing of another's requests from what the stack reports.

- `cached_tokens`: an image another salt (or no salt) sent is encoded once for everyone, but its tokens count as
  cached only for a salt that sent it before (decoder_service/image_hits.py).
- The decoder's open /health lists the proxy's prefix keys; they are keyed with the fleet's internal key, so the
  key of a guessed conversation, computed the way the proxy would without the secret, is not among them.
- The proxy's open /health says only that it serves; the worker list needs the internal key. HEAD /health is a
  200 on every service.
"""
from __future__ import annotations

import base64
import uuid
from typing import Any

import httpx

from proxy.config import ProxyConfig
from proxy.prepare import prepare_chat
from proxy.protocol import ChatCompletionRequest
from tests.e2e.stack import demo_png
from tests.hostile.stack import HostileStack


def chat(stack: HostileStack, image: bytes, text: str, salt: str | None) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    body: dict[str, Any] = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 2,
                            "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json()["usage"])


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_an_image_hit_counts_as_cached_only_for_the_salt_that_sent_it(stack: HostileStack) -> None:
    image, text = demo_png("green", 30_001), f"What color is the shape? {uuid.uuid4().hex}"
    salt_a = f"tenantA-{uuid.uuid4().hex}"
    assert cached(chat(stack, image, text, salt_a)) == 0  # first sight: encoded for A
    # the same picture from another tenant: its embeddings are reused, but nothing says so
    assert cached(chat(stack, image, text, f"tenantB-{uuid.uuid4().hex}")) == 0
    assert cached(chat(stack, image, f"{text} (no salt)", None)) == 0
    again = chat(stack, image, f"{text} (later)", salt_a)  # A again: the image (and A's prefix) are A's own hits
    assert cached(again) > 0
    assert cached(chat(stack, image, f"{text} (no salt, later)", None)) > 0  # "" is everyone's, as for K/V


def test_the_decoders_health_is_no_oracle_for_a_guessed_conversation(stack: HostileStack) -> None:
    messages = [{"role": "user", "content": f"a private question {uuid.uuid4().hex}"}]
    body = {"model": "demo", "messages": messages, "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120).status_code == 200
    # the attacker's guess: the keys the proxy would compute for that conversation, without the fleet's secret
    guess = prepare_chat(ChatCompletionRequest.model_validate(body),
                         ProxyConfig(encode_urls=(), decode_urls=("http://x",), aggregated=True)).prefix_keys
    own = prepare_chat(ChatCompletionRequest.model_validate(body),
                       ProxyConfig(encode_urls=(), decode_urls=("http://x",), aggregated=True,
                                   internal_key=stack.internal_key)).prefix_keys
    held = httpx.get(f"{stack.urls['decoder']}/health", timeout=30).json()["prefix_cache"]["keys"]
    assert set(own) <= set(held)  # the fleet's own keys are there: affinity still works
    assert not set(guess) & set(held)


def test_the_proxys_open_health_names_no_worker_and_head_answers_everywhere(stack: HostileStack) -> None:
    assert httpx.get(f"{stack.base_url}/health", timeout=30).json() == {"status": "ok", "role": "proxy"}
    detailed = httpx.get(f"{stack.base_url}/health", timeout=30,
                         headers={"Authorization": f"bearer {stack.internal_key}"}).json()  # any case of the scheme
    assert [w["url"] for w in detailed["decoders"]] == [stack.urls["decoder"]]
    for url in stack.urls.values():
        resp = httpx.head(f"{url}/health", timeout=30)
        assert resp.status_code == 200 and resp.content == b""
