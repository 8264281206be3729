"""Bounded resources at the HTTP layer, against real processes: a chunked 200 MB body to the proxy, an encoder
and a decoder is refused at each one's cap with its memory bounded; a slow-body client is dropped while others
are served; slow image hosts neither hold the proxy past its media deadline nor block other requests.

One stack for the module (tests/hostile/stack.py: attach mode, the demo model), each process started with an
8 MiB body cap, so the bound on memory is the cap plus the servers' read-ahead, not the flood; two other users
stream side by side with each flood and must get exactly the tokens they get alone.
"""
from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.e2e.stack import demo_png
from tests.hostile.http_client import Reply, flood_chunked, trickle_body
from tests.hostile.memory import peak_rss_bytes, rss_bytes
from tests.hostile.stack import HostileStack, hostile_stack, run_victims
from tests.proxy.media_helpers import ThreadingCountingServer, Trickle, running, serve, wait_for

pytestmark = pytest.mark.e2e

CAP = 8 << 20  # --max-body-bytes of every process here
FLOOD = 200 << 20  # what the attacker would send
RSS_BOUND = 32 << 20  # growth of each process's peak RSS while refusing the flood (measured: 9-10 MiB each)
LIMIT_FLAGS = ["--max-body-bytes", str(CAP), "--body-read-timeout", "2"]
MEDIA_DEADLINE = 8.0  # long enough for an ordinary request to finish while the slow ones hang


@dataclass
class Stack:
    hs: HostileStack
    trickle: Trickle
    images: ThreadingCountingServer
    reference: str  # the demo's answer to an ordinary request, before any attack

    @property
    def proxy(self) -> str:
        return self.hs.base_url


def reset_peak(pid: int) -> None:
    """Start VmHWM (peak RSS) afresh from the current RSS (Linux: clear_refs 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def answer(stack: Stack) -> str:
    return stack.hs.answers_red()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    trickle = Trickle()
    proxy_args = [*LIMIT_FLAGS, "--allowed-media-domains", "127.0.0.1", "localhost", "--max-concurrent-fetches", "2",
                  "--media-fetch-deadline", str(MEDIA_DEADLINE)]
    with running(ThreadingCountingServer()) as images, hostile_stack(
            tmp_path_factory.mktemp("limits"), encoder_args=LIMIT_FLAGS, decoder_args=LIMIT_FLAGS,
            proxy_args=proxy_args) as hs:
        images.routes["/slow.png"] = trickle
        images.routes["/red.png"] = serve(demo_png("red", 7))
        yield Stack(hs, trickle, images, hs.answers_red())
        trickle.release.set()


PATHS = {"proxy": "/v1/chat/completions", "encoder": "/encode", "decoder": "/generate"}


@pytest.mark.parametrize("role", ["proxy", "encoder", "decoder"])
def test_a_chunked_flood_is_refused_at_the_cap_with_memory_bounded(stack: Stack, role: str) -> None:
    pid, port = stack.hs.pids[role], int(stack.hs.urls[role].rsplit(":", 1)[1])
    auth = "" if role == "proxy" else f"Authorization: Bearer {stack.hs.internal_key}\r\n"
    reset_peak(pid)
    before = rss_bytes(pid)
    run = run_victims(stack.proxy, during=lambda: flood_chunked(port, PATHS[role], FLOOD, extra=auth))
    reply, sent = run.during
    assert reply.status == 413 and reply.body is not None and reply.body["error"]["code"] == "body_too_large"
    assert sent < FLOOD // 4  # refused while the flood was still coming
    growth = peak_rss_bytes(pid) - before
    assert growth < RSS_BOUND, f"{role} peak RSS grew by {growth >> 20} MiB"
    run.assert_undisturbed()  # two other users' streams: exactly the tokens they produce alone
    assert answer(stack) == stack.reference  # an ordinary request right after: the same answer


def test_a_slow_body_gets_408_while_others_are_served(stack: Stack) -> None:
    port = int(stack.proxy.rsplit(":", 1)[1])
    body = b'{"model": "demo", "messages": [{"role": "user", "content": "' + b"x" * 200 + b'"}]}'
    with ThreadPoolExecutor(4) as pool:
        slow = pool.submit(trickle_body, port, "/v1/chat/completions", body, 0.25)
        others = [pool.submit(answer, stack) for _ in range(3)]
        reply: Reply = slow.result(timeout=120)
        assert [f.result(timeout=120) for f in others] == [stack.reference] * 3
    assert reply.status == 408 and reply.body is not None and reply.body["error"]["code"] == "body_read_timeout"


def image_request(url: str) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What color is the shape?"}]
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}


def test_slow_image_hosts_hit_the_deadline_and_starve_no_one(stack: Stack) -> None:
    """Two slow downloads fill --max-concurrent-fetches 2: a third one waits for a slot and is answered by its
    deadline (503 if no slot came, else 408); a data: URL request is served meanwhile; each slow one gets its
    408 at the deadline, its download is abandoned (the host sees the hang-up), and a fetch from another host
    works right after."""
    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{stack.proxy}/v1/chat/completions", json=body, timeout=60)

    slow_url = stack.images.url("/slow.png")
    abandoned = stack.trickle.abandoned
    with ThreadPoolExecutor(3) as pool:
        slow = [pool.submit(post, image_request(f"{slow_url}?{i}")) for i in range(2)]
        assert wait_for(lambda: stack.trickle.active == 2)
        queued = pool.submit(post, image_request(f"{slow_url}?queued"))
        inline = "data:image/png;base64," + base64.b64encode(demo_png("red", 3)).decode()
        served_inline = post(image_request(inline))
        assert served_inline.status_code == 200 and stack.trickle.active == 2  # served while both still hang
        results = [f.result(timeout=60) for f in slow]
        busy = queued.result(timeout=60)
    for r in results:
        assert r.status_code == 408 and r.json()["error"]["code"] == "image_fetch_timeout"
        assert r.json()["error"]["param"] == "messages.0.content.0.image_url.url"
    assert (busy.status_code, busy.json()["error"]["code"]) in ((503, "media_fetch_busy"), (408, "image_fetch_timeout"))
    assert wait_for(lambda: stack.trickle.abandoned >= abandoned + 2 and stack.trickle.active == 0)
    other_host = post(image_request(stack.images.url("/red.png", "localhost")))  # demo_png("red", 7): reference
    assert other_host.status_code == 200
    assert other_host.json()["choices"][0]["message"]["content"] == stack.reference


def test_every_process_is_alive_after_the_attacks(stack: Stack) -> None:
    assert stack.hs.dead() == []
    for url in stack.hs.urls.values():
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert answer(stack) == stack.reference
