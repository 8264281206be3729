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
