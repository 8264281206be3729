"""Two real decoders behind the launcher: each conversation's follow-up lands on the decoder that holds its prefix
(the proxy's prefix affinity), and reuses it there (cached_tokens), with the answer the cache-off path gives."""
from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.stack import Stack, demo_png, health, launched, urls_of

NUM_CONVERSATIONS = 6


def chat(stack: Stack, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"model": "demo", "messages": messages, "max_tokens": 6, "temperature": 0, **extra}
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def first_turn(i: int) -> list[dict[str, Any]]:
    system = {"role": "system", "content": f"Conversation {i}: answer about pictures and numbers in short words."}
    if i % 2:  # half the conversations start with a picture
        url = "data:image/png;base64," + base64.b64encode(demo_png("red", seed=i)).decode()
        return [system, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "What color is the shape?"}]}]
    return [system, {"role": "user", "content": f"Count to {i + 3} in words, please."}]


def conversations(stack: Stack, **extra: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every conversation's turn 1 at once (so both decoders get some), then every turn 2 at once."""
    with ThreadPoolExecutor(NUM_CONVERSATIONS) as pool:
        firsts = list(pool.map(lambda i: chat(stack, first_turn(i), **extra), range(NUM_CONVERSATIONS)))
        seconds = list(pool.map(
            lambda i: chat(stack, [*first_turn(i), {"role": "assistant", "content": firsts[i]["choices"][0]["message"]
                                                    ["content"]}, {"role": "user", "content": "And then?"}], **extra),
            range(NUM_CONVERSATIONS)))
    return list(zip(firsts, seconds, strict=True))


def test_follow_ups_land_where_their_prefix_is(tmp_path: Path) -> None:
    with launched(tmp_path, "--model", "demo", "--num-encoders", "1", "--num-decoders", "2") as stack:
        turns = conversations(stack)
        decoders = [health(u)["prefix_cache"] for u in urls_of(stack, "decoders")]
        proxy_metrics = stack.get("/metrics").text
    assert all(d["blocks"] > 0 for d in decoders), "turn 1 went to both decoders"
    for first, second in turns:
        # turn 2 reused at least turn 1's whole prompt blocks: it ran where turn 1 ran (elsewhere it would count only
        # the picture's 64 held tokens, fewer than turn 1's prompt)
        reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reused >= first["usage"]["prompt_tokens"] // 16 * 16, (first["usage"], second["usage"])
    assert 'epd_proxy_affinity_routed_total{result="hit"}' in proxy_metrics
