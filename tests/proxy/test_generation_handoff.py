"""E -> P -> D in the proxy's Generation: a request opens on a prefill worker with a hand-off key, its first tokens
reach the client from there, its `handoff` event (never sent on) reopens it on a decode worker with the hand-off;
a prefill worker that fails before its first event is replaced, none healthy means E + PD on a decoder, and a
decode worker that fails before its first event is replaced with the same hand-off. A prefill worker's `declined`
(a short prompt) runs the request on a decoder, E + PD."""
from __future__ import annotations

import asyncio
from typing import Any

from proxy.upstream import WorkerFailed
from tests.proxy.test_generation import CHAT, DONE, FakeFleet, FakeStream, delta, run

HANDOFF = {"key": "k", "source": "tcp://p0:9", "num_tokens": 7, "choices": [{"first_token": 42}]}


def handoff() -> dict[str, Any]:
    return {"type": "handoff", "handoff": HANDOFF}


def test_the_first_token_comes_from_the_prefill_worker_and_the_rest_from_a_decoder() -> None:
    fleet = FakeFleet({"p0": [FakeStream([delta("Hel"), handoff()])], "d0": [FakeStream([delta("lo"), DONE])]})
    _, events = asyncio.run(run(fleet))
    assert events == [delta("Hel"), delta("lo"), DONE]  # the hand-off itself never reaches the client
    (p_url, p_body), (d_url, d_body) = fleet.opened
    assert (p_url, d_url) == ("p0", "d0")
    assert p_body["handoff_key"] and "handoff" not in p_body
    assert d_body["handoff"] == HANDOFF and "handoff_key" not in d_body
    assert [w.load for w in fleet.workers.by_url.values()] == [0, 0]


def test_a_continued_choice_reports_what_the_prefill_reused() -> None:
    reused = {"type": "handoff", "handoff": {**HANDOFF, "cached_tokens": 16}}
    fleet = FakeFleet({"p0": [FakeStream([delta("a"), reused])], "d0": [FakeStream([delta("b"), DONE])]})
    _, events = asyncio.run(run(fleet))  # the decode worker reused none of the prompt: it prefilled nothing
    assert events == [delta("a"), delta("b"), {**DONE, "usage": {**DONE["usage"], "cached_tokens": 16}}]
    ended = {**DONE, "index": 1, "usage": {**DONE["usage"], "cached_tokens": 3}}  # a choice done on the prefill worker
    fleet = FakeFleet({"p0": [FakeStream([delta("a"), ended, reused])], "d0": [FakeStream([DONE])]})
    _, events = asyncio.run(run(fleet))
    assert [e["usage"]["cached_tokens"] for e in events if e["type"] == "done"] == [3, 16]


def test_a_first_token_that_ends_the_request_needs_no_decoder() -> None:
    fleet = FakeFleet({"p0": [FakeStream([delta("x"), DONE])], "d0": []})
    _, events = asyncio.run(run(fleet))
    assert events == [delta("x"), DONE] and [url for url, _ in fleet.opened] == ["p0"]


def test_a_prefill_worker_lost_before_its_first_event_is_replaced() -> None:
    fleet = FakeFleet({"p0": [WorkerFailed("ConnectError")], "p1": [FakeStream([delta("a"), handoff()])],
                       "d0": [FakeStream([delta("b"), DONE])]})
    _, events = asyncio.run(run(fleet))
    assert events == [delta("a"), delta("b"), DONE]
    assert [url for url, _ in fleet.opened] == ["p0", "p1", "d0"]


def test_with_no_prefill_worker_healthy_the_request_runs_on_a_decoder() -> None:
    fleet = FakeFleet({"p0": [], "d0": [FakeStream([delta("ab"), DONE])]})
    fleet.workers.mark_down(fleet.workers.by_url["p0"], "down")
    _, events = asyncio.run(run(fleet))
    assert events == [delta("ab"), DONE]
    assert [url for url, _ in fleet.opened] == ["d0"] and "handoff_key" not in fleet.opened[0][1]


def test_a_decoder_lost_before_its_first_event_is_replaced_with_the_same_hand_off() -> None:
    fleet = FakeFleet({"p0": [FakeStream([delta("a"), handoff()])], "d0": [FakeStream([], drop=True)],
                       "d1": [FakeStream([delta("b"), DONE])]})
    _, events = asyncio.run(run(fleet))
    assert events == [delta("a"), delta("b"), DONE]
    assert [url for url, _ in fleet.opened] == ["p0", "d0", "d1"] and fleet.opened[2][1]["handoff"] == HANDOFF


def test_with_no_decode_worker_a_prefill_worker_runs_the_request_whole() -> None:
    for script in ({"p0": [FakeStream([delta("ab"), DONE])]},  # none configured
                   {"p0": [FakeStream([delta("ab"), DONE])], "d0": []}):  # the only one down
        fleet = FakeFleet(script)
        if "d0" in script:
            fleet.workers.mark_down(fleet.workers.by_url["d0"], "killed")
        _, events = asyncio.run(run(fleet))
        assert events == [delta("ab"), DONE]  # never a first token that nothing could continue
        assert [url for url, _ in fleet.opened] == ["p0"]
        assert "handoff_key" not in fleet.opened[0][1] and "handoff" not in fleet.opened[0][1]
        assert fleet.metrics.handoffs.value == 0 and fleet.workers.by_url["p0"].load == 0


def test_a_hand_off_whose_decode_worker_died_continues_on_the_prefill_worker() -> None:
    fleet = FakeFleet({"p0": [FakeStream([delta("a"), handoff()]), FakeStream([delta("b"), DONE])],
                       "d0": [WorkerFailed("ConnectError")]})  # healthy at the check, dead when asked
    fleet.workers.add("prefill", "p1").healthy = True  # holds none of the prompt
    _, events = asyncio.run(run(fleet))
    assert events == [delta("a"), delta("b"), DONE]
    assert [url for url, _ in fleet.opened] == ["p0", "d0", "p0"]
    assert fleet.acquired[2] == ("p0", list(CHAT.prefix_keys))  # chosen by the prompt's keys: it holds its K/V
    assert fleet.opened[2][1]["handoff"] == HANDOFF and "handoff_key" not in fleet.opened[2][1]
    assert fleet.failed == [("d0", False)] and [w.load for w in fleet.workers.by_url.values()] == [0, 0, 0]


def test_with_no_worker_left_for_a_hand_off_the_stream_ends_with_an_error() -> None:
    fleet = FakeFleet({"p0": [FakeStream([delta("a"), handoff()]), WorkerFailed("ConnectError")],
                       "d0": [WorkerFailed("ConnectError")]})
    _, events = asyncio.run(run(fleet))
    assert events[0] == delta("a") and events[1]["type"] == "error" and len(events) == 2
    assert "decode worker" in events[1]["message"]


def test_a_hand_off_from_a_decoder_that_was_not_asked_for_one_is_an_error() -> None:
    fleet = FakeFleet({"d0": [FakeStream([delta("a"), handoff()])]})
    _, events = asyncio.run(run(fleet))
    assert events[0] == delta("a") and events[1]["type"] == "error"


def test_a_declined_hand_off_runs_on_a_decoder_without_one() -> None:
    declined = {"type": "declined", "message": "12 prompt tokens to prefill, under --handoff-min-tokens 512"}
    fleet = FakeFleet({"p0": [FakeStream([declined])], "d0": [FakeStream([delta("ab"), DONE])]})
    _, events = asyncio.run(run(fleet))
    assert events == [delta("ab"), DONE]  # the decline never reaches the client
    (p_url, p_body), (d_url, d_body) = fleet.opened
    assert (p_url, d_url) == ("p0", "d0") and p_body["handoff_key"]
    assert "handoff" not in d_body and "handoff_key" not in d_body  # E + PD: the decoder prefills it
    assert (fleet.metrics.handoffs_declined.value, fleet.metrics.handoffs.value) == (1, 0)
    assert [w.load for w in fleet.workers.by_url.values()] == [0, 0] and fleet.failed == []


def test_a_decline_after_first_tokens_or_unasked_for_is_an_error() -> None:
    declined = {"type": "declined", "message": "short"}
    for script in ({"p0": [FakeStream([delta("a"), declined])], "d0": []}, {"d0": [FakeStream([declined])]}):
        fleet = FakeFleet(script)
        _, events = asyncio.run(run(fleet))
        assert events[-1]["type"] == "error" and "declined" in events[-1]["message"]
        assert fleet.metrics.handoffs_declined.value == 0


def test_the_prefill_worker_is_chosen_by_prefix_and_the_decoder_by_load() -> None:
    fleet = FakeFleet({"p0": [FakeStream([delta("a"), handoff()])], "d0": [FakeStream([DONE])]})
    asyncio.run(run(fleet))
    (_, prefill_keys), (_, decode_keys) = fleet.acquired
    assert decode_keys == []  # by load alone; the prefill worker by the request's prefix keys
    assert prefill_keys == list(CHAT.prefix_keys)
