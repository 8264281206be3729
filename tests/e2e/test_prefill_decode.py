"""E -> P -> D through the launcher (demo model; one encoder, one prefill worker, one decoder), secure by default
(CURVE on the K/V link too): a chat request prefills on the prefill worker, its K/V travels to the decoder, and the
answer is the one an E + PD stack gives, token for token. One stack for the module."""
from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.stack import Stack, ask_colour, demo_png, launched, metric, urls_of

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Stack]]:
    env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("EPD_")}  # keys made per start
    try:
        with launched(tmp_path_factory.mktemp("epd"), "--model", "demo", "--num-encoders", "1",
                      "--num-decoders", "1", "--num-prefills", "1", "--handoff-min-tokens", "0") as split, \
                launched(tmp_path_factory.mktemp("e-pd"), "--model", "demo", "--num-encoders", "1",
                         "--num-decoders", "1") as together:
            yield split, together
    finally:
        os.environ.update(env)


def answer(stack: Stack, *images: bytes) -> str:
    resp = ask_colour(stack.base_url, *images)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def test_a_request_prefills_on_the_prefill_worker_and_decodes_on_the_decoder(stacks: tuple[Stack, Stack]) -> None:
    split, together = stacks
    images = [demo_png("blue", 31), demo_png("green", 32)]
    assert answer(split, *images) == answer(together, *images)
    assert metric(split.get("/metrics").text, "epd_proxy_handoffs_total") == 1
    decoder = urls_of(split, "decoders")[0]
    resumes = httpx.get(f"{decoder}/metrics", timeout=30).text
    assert 'epd_decoder_handoff_resumes_total{how="kv"} 1.0' in resumes  # the K/V came over CURVE, not recomputed
    prefills = [w for w in split.info()["prefills"]]
    assert len(prefills) == 1 and prefills[0]["healthy"]


def test_a_repeated_prompt_reports_what_was_reused_as_one_worker_would(stacks: tuple[Stack, Stack]) -> None:
    """Split, the same prompt with the same salt reported cached_tokens 0 every time."""
    def cached(stack: Stack, salt: str) -> int:
        text = "Tell me about the colours of the rainbow, one by one, and what each one means to you. " * 4
        body = {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0,
                "cache_salt": salt}
        resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    split, together = stacks
    handoffs = metric(split.get("/metrics").text, "epd_proxy_handoffs_total")
    seen = {name: [cached(stack, "t13"), cached(stack, "t13"), cached(stack, "t13-other")]
            for name, stack in (("split", split), ("together", together))}
    assert seen["split"] == seen["together"], seen
    assert seen["split"][0] == 0 and seen["split"][1] > 0 and seen["split"][2] == 0, seen
    assert metric(split.get("/metrics").text, "epd_proxy_handoffs_total") == handoffs + 3  # each was handed off
