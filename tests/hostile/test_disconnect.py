"""A client that goes away stops its generation: streaming or not, before or after the first byte, and while
the proxy is still loading its images (then no generation is opened at all).

One in-process stack for the module: a decoder on the tiny LLaVA LM and a proxy in front of it, each behind
uvicorn in a thread, so the decoder's engine can be read directly (running sequences, finish reasons).
"""
from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from decoder_service.config import DecoderConfig
from decoder_service.server import create_app as decoder_app
from decoder_service.shell import Engine
from epd_common.server import HttpLimits
from epd_models.halves import LanguageHalf
from proxy.app import create_app as proxy_app
from proxy.config import ProxyConfig
from tests.e2e.stack import metric
from tests.hostile.http_client import connect, served
from tests.proxy.media_helpers import ThreadingCountingServer, Trickle, running, wait_for

MAX_TOKENS = 3000  # far more than a test would wait for: only an abort ends these early


@dataclass
class Stack:
    proxy: str
    decoder: str
    engine: Engine
    slow_image: str
    trickle: Trickle

    def finished(self) -> int:
        return sum(self.engine.scheduler.finished.values())

    def decoder_metric(self, name: str) -> float:
        return metric(httpx.get(f"{self.decoder}/metrics", timeout=30).text, name)

    def proxy_metric(self, name: str) -> float:
        return metric(httpx.get(f"{self.proxy}/metrics", timeout=30).text, name)


@pytest.fixture(scope="module")
def stack(tiny_model_dirs: dict[str, Path]) -> Iterator[Stack]:
    trickle = Trickle()
    dcfg = DecoderConfig(max_num_seqs=4, max_prefill_tokens=1024)
    dapp = decoder_app(dcfg, lm=LanguageHalf(tiny_model_dirs["llava"]))
    with running(ThreadingCountingServer()) as images, served(dapp, HttpLimits()) as dport:
        images.routes["/slow.png"] = trickle
        decoder = f"http://127.0.0.1:{dport}"
        pcfg = ProxyConfig(encode_urls=(), decode_urls=(decoder,), aggregated=True, served_model_name="tiny",
                           allowed_media_domains=("127.0.0.1",), media_fetch_deadline=60.0)
        with served(proxy_app(pcfg), HttpLimits()) as pport:
            yield Stack(f"http://127.0.0.1:{pport}", decoder, dapp.state.decoder.engine,
                        images.url("/slow.png"), trickle)
        trickle.release.set()


def chat(stream: bool, image_url: str | None = None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "Describe the weather."}]
    if image_url:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url}})
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": stream}


def post_raw(base_url: str, body: dict[str, Any]) -> socket.socket:
    """Send the request on a socket of our own, so the test decides when the client goes away."""
    port = int(base_url.rsplit(":", 1)[1])
    data = json.dumps(body).encode()
    sock = connect(port)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def leave_mid_generation(stack: Stack, stream: bool) -> tuple[int, float]:
    """Start a long generation, hang up once it runs; (aborts, tokens generated) it caused on the decoder."""
    finished = stack.engine.scheduler.finished
    aborts, tokens = finished["abort"], stack.decoder_metric("epd_decoder_generated_tokens_total")
    sock = post_raw(stack.proxy, chat(stream))
    assert wait_for(lambda: stack.engine.num_running == 1)
    if stream:
        sock.settimeout(30)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # after the first byte
    sock.close()
    assert wait_for(lambda: stack.engine.num_running == 0 and finished["abort"] == aborts + 1)
    return finished["abort"] - aborts, stack.decoder_metric("epd_decoder_generated_tokens_total") - tokens


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_client_that_leaves_stops_its_generation(stack: Stack, stream: bool) -> None:
    aborted, tokens = leave_mid_generation(stack, stream)
    assert aborted == 1 and tokens < MAX_TOKENS / 2
    answer = httpx.post(f"{stack.proxy}/v1/chat/completions", json={**chat(False), "max_tokens": 3}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3


def test_a_client_that_leaves_while_its_images_load_opens_no_generation(stack: Stack) -> None:
    finished, calls = stack.finished(), stack.decoder_metric("epd_decoder_requests_total")
    left = stack.proxy_metric("epd_proxy_requests_total")
    sock = post_raw(stack.proxy, chat(False, stack.slow_image))
    assert wait_for(lambda: stack.trickle.active == 1)  # the proxy is downloading the image
    sock.close()
    assert wait_for(lambda: stack.proxy_metric("epd_proxy_requests_total") == left + 1)  # the proxy saw it go
    stack.trickle.release.set()  # the download can finish now; nobody is waiting for it
    assert wait_for(lambda: stack.trickle.active == 0)
    assert stack.decoder_metric("epd_decoder_requests_total") == calls and stack.finished() == finished
    assert stack.engine.num_waiting == 0 and stack.engine.num_running == 0
