"""Prefix affinity through the proxy app, two fake decoders behind it that keep a prefix cache: conversations'
follow-ups land on the decoder holding their prefix, whether its /health said so or the proxy saw it finish there;
a busy holder loses them past the load gap; --no-prefix-affinity routes by load alone."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.prefix_keys import chat_prefix_keys
from proxy.worker_state import Worker
from tests.proxy.fake_decoder import FakeDecoder

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}  # shared: every decoder holds its key


def first_turn(k: int) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": f"Conversation {k}: hello"}]


def seed(*conversations: int) -> list[str]:
    """The keys a decoder reports holding once it served these conversations' first turns."""
    return [key for k in conversations for key in chat_prefix_keys(first_turn(k), [], [])]


class Stack:
    """The proxy app in front of decoders a (holding conversations 0 and 2) and b (1 and 3)."""

    def __init__(self, prefix_affinity: bool = True) -> None:
        self.a, self.b = FakeDecoder(held=seed(0, 2)), FakeDecoder(held=seed(1, 3))
        # no probe during a test (the start-up one reads the seeds): what the proxy learns after is from finishes
        cfg = ProxyConfig(encode_urls=(), decode_urls=(self.a.url, self.b.url), aggregated=True, startup_timeout=10.0,
                          health_interval=3600.0, prefix_affinity=prefix_affinity)
        self.client = TestClient(create_app(cfg))

    def close(self) -> None:
        self.a.close()
        self.b.close()

    def worker(self, fake: FakeDecoder) -> Worker:
        worker: Worker = self.client.app.state.proxy.started.workers.by_url[fake.url]  # type: ignore[attr-defined]
        return worker

    def ask(self, messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        """(which decoder answered, the conversation with its answer)."""
        before = len(self.a.bodies), len(self.b.bodies)
        resp = self.client.post("/v1/chat/completions", json={"model": "demo", "messages": messages})
        assert resp.status_code == 200, resp.text
        served = "a" if len(self.a.bodies) > before[0] else "b"
        assert len(self.a.bodies) + len(self.b.bodies) == sum(before) + 1
        return served, [*messages, resp.json()["choices"][0]["message"]]

    def routed(self, result: str) -> float:
        line = f'epd_proxy_affinity_routed_total{{result="{result}"}} '
        return float(next(x for x in self.client.get("/metrics").text.splitlines() if x.startswith(line)).split()[1])


@pytest.fixture
def stack() -> Iterator[Stack]:
    stack = Stack()
    with stack.client:
        yield stack
    stack.close()


def test_follow_ups_land_on_the_decoder_holding_their_conversation(stack: Stack) -> None:
    conversations = {k: first_turn(k) for k in range(4)}
    conversations = {k: [*m, {"role": "assistant", "content": "Hi!"}] for k, m in conversations.items()}
    for turn in range(3):
        for k in (3, 0, 1, 2):  # interleaved, so load alone would send them all to a
            served, conversations[k] = stack.ask([*conversations[k], {"role": "user", "content": f"turn {turn}"}])
            assert served == "ab"[k % 2], (k, turn)
    assert stack.routed("hit") == 12 and stack.routed("miss") == stack.routed("overloaded") == 0
    body = stack.a.bodies[-1]  # conversation 2's last follow-up: its keys extend those a reported for it
    assert body["prefix_keys"][:2] == seed(2) and len(body["prefix_keys"]) == len(body["messages"]) == 8


def test_a_conversation_stays_where_it_finished_before_any_health_says_so(stack: Stack) -> None:
    # a busy, at the load bound (2 in flight on 2 decoders: ceil(1.25 * 3 / 2) = 2): the new conversation starts on b
    # (nobody holds it), wherever its rendezvous home is
    stack.worker(stack.a).load = 2
    served, conversation = stack.ask([{"role": "user", "content": "A new conversation"}])
    stack.worker(stack.a).load = 0
    assert served == "b" and stack.routed("miss") == 1
    served, _ = stack.ask([*conversation, {"role": "user", "content": "and more"}])  # by load: a
    assert served == "b" and stack.routed("hit") == 1


def test_a_holder_busier_than_the_load_gap_loses_the_request(stack: Stack) -> None:
    follow_up = [*first_turn(0), {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "more"}]
    stack.worker(stack.a).load = 4  # the default gap: still a's
    assert stack.ask(follow_up)[0] == "a"
    stack.worker(stack.a).load = 5
    assert stack.ask(follow_up)[0] == "b"
    stack.worker(stack.a).load = 0
    assert stack.routed("hit") == 1 and stack.routed("overloaded") == 1


def test_without_prefix_affinity_decoders_are_chosen_by_load_alone() -> None:
    stack = Stack(prefix_affinity=False)
    with stack.client:
        served = [stack.ask([*first_turn(k), {"role": "assistant", "content": "Hi!"},
                             {"role": "user", "content": "more"}])[0] for k in range(4)]
        assert served == ["a"] * 4 and stack.routed("hit") == stack.routed("miss") == 0
    stack.close()
