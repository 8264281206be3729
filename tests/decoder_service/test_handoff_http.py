"""E -> P -> D between two decoder workers over HTTP and the K/V connector (ZeroMQ on loopback): a prefill worker's
stream ends with a `handoff` event naming its K/V endpoint; a decode worker given that hand-off fetches the blocks
and streams the rest; joined, the two streams are the stream one worker sends alone. A hand-off whose K/V is gone
is prefilled by the decode worker (counted), and a worker that is not --role prefill refuses `handoff_key`."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from decoder_service.config import DecoderConfig
from decoder_service.server import create_app
from epd_models.halves import LanguageHalf

MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Name three colours and describe each one."}]}]
SAMPLING = {"temperature": 0.8, "seed": 9, "max_tokens": 20, "ignore_eos": True}


@pytest.fixture(scope="module")
def workers(tiny_model_dirs: dict[str, Path]) -> Iterator[dict[str, TestClient]]:
    lm = LanguageHalf(tiny_model_dirs["qwen2_vl"])
    clients: dict[str, TestClient] = {}
    try:
        for name, role, min_tokens in (("both", "both", 0), ("prefill", "prefill", 0), ("decode", "decode", 0),
                                       ("picky", "prefill", 10_000)):  # picky: hands off no prompt shorter than 10k
            app = create_app(DecoderConfig(max_num_seqs=4, role=role, max_model_len=512, kv_ttl=60,
                                           handoff_min_tokens=min_tokens), lm=lm)
            clients[name] = TestClient(app).__enter__()
        yield clients
    finally:
        for client in clients.values():
            client.__exit__(None, None, None)


def events(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/generate", json={"messages": MESSAGES, "sampling": SAMPLING, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line) for line in resp.iter_lines() if line]


def shown(stream: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["type"], e.get("text", ""), e.get("finish_reason"), (e.get("usage") or {}).get("completion_tokens"))
            for e in stream if e["type"] != "handoff"]


def metric(client: TestClient, name: str) -> str:
    return "\n".join(line for line in client.get("/metrics").text.splitlines() if line.startswith(name))


def test_a_request_prefilled_on_one_worker_continues_on_another(workers: dict[str, TestClient]) -> None:
    alone = events(workers["both"], {})
    first = events(workers["prefill"], {"handoff_key": "req-1"})
    handoff = first[-1]
    assert handoff["type"] == "handoff" and handoff["handoff"]["source"].startswith("tcp://")
    assert workers["prefill"].get("/health").json()["kv_address"] == handoff["handoff"]["source"]
    rest = events(workers["decode"], {"handoff": handoff["handoff"]})
    assert shown(first) + shown(rest) == shown(alone)
    assert 'how="kv"} 1.0' in metric(workers["decode"], "epd_decoder_handoff_resumes_total")


def test_a_hand_off_whose_blocks_are_gone_is_prefilled_by_the_decode_worker(workers: dict[str, TestClient]) -> None:
    alone = events(workers["both"], {})
    first = events(workers["prefill"], {"handoff_key": "req-2"})
    lost = {**first[-1]["handoff"], "key": "never-kept"}  # the prefill worker has nothing under this key
    rest = events(workers["decode"], {"handoff": lost})
    assert shown(first) + shown(rest) == shown(alone)
    assert 'how="recomputed"} 1.0' in metric(workers["decode"], "epd_decoder_handoff_resumes_total")


def test_a_prefill_worker_frees_a_hand_off_once_its_decode_worker_has_it(workers: dict[str, TestClient]) -> None:
    """Not at the next hand-off, not at its TTL: the decode worker's kv_release, sent once it has the blocks (and
    answered before its stream starts). /health and /metrics show the store."""
    def store() -> dict[str, Any]:
        return dict(workers["prefill"].get("/health").json()["kv_store"])

    before = store()
    first = events(workers["prefill"], {"handoff_key": "req-freed"})
    held = store()
    assert held["puts"] == before["puts"] + 1 and held["bytes"] > 0 and held["max_bytes"] > held["bytes"]
    assert f"epd_decoder_kv_store_items {float(held['items'])}" in metric(workers["prefill"], "epd_decoder_kv_store")
    events(workers["decode"], {"handoff": first[-1]["handoff"]})
    after = store()
    assert after["released"] == before["released"] + 1 and after["kv_releases"] == before["kv_releases"] + 1
    assert after["items"] == held["items"] - 1 - (after["expired"] - held["expired"])  # gone, whatever else expired
    freed = metric(workers["prefill"], "epd_decoder_kv_store_freed_total")
    assert f'why="released"}} {float(after["released"])}' in freed
    assert "kv_store" not in workers["decode"].get("/health").json()  # a decode worker keeps no hand-offs
    assert metric(workers["decode"], "epd_decoder_kv_store") == ""


def test_a_hand_off_carries_what_the_prefill_reused(workers: dict[str, TestClient]) -> None:
    """A repeated prompt of the same salt reuses the prefill worker's prefix cache: its hand-off says how much (the
    proxy reports it as usage's cached_tokens), as much as one worker alone reports; another salt reuses none."""
    def reused_alone(salt: str) -> int:
        done = [e for e in events(workers["both"], {"cache_salt": salt}) if e["type"] == "done"]
        return int(done[0]["usage"]["cached_tokens"])

    def reused_split(salt: str, key: str) -> int:
        return int(events(workers["prefill"], {"handoff_key": key, "cache_salt": salt})[-1]["handoff"]
                   .get("cached_tokens", 0))

    alone = [reused_alone("item13"), reused_alone("item13"), reused_alone("item13-other")]
    split = [reused_split("item13", "r13-1"), reused_split("item13", "r13-2"), reused_split("item13-other", "r13-3")]
    assert split == alone and alone[0] == 0 and alone[1] > 0 and alone[2] == 0


def test_only_a_prefill_worker_takes_a_handoff_key(workers: dict[str, TestClient]) -> None:
    resp = workers["decode"].post("/generate", json={"messages": MESSAGES, "sampling": SAMPLING, "handoff_key": "x"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "handoff_key"
    resp = workers["decode"].post("/generate", json={"messages": MESSAGES, "sampling": SAMPLING, "handoff_key": "a b"})
    assert resp.status_code == 400  # not a key's characters


def test_a_prefill_worker_declines_a_prompt_under_its_handoff_min_tokens(workers: dict[str, TestClient]) -> None:
    picky = workers["picky"]
    prompt_tokens = next(e for e in events(workers["both"], {}) if e["type"] == "done")["usage"]["prompt_tokens"]
    before = picky.get("/health").json()["kv_cache"]
    assert events(picky, {"handoff_key": "short-1"}) == [
        {"type": "declined", "message": f"{prompt_tokens} prompt tokens to prefill, under --handoff-min-tokens 10000"}]
    after = picky.get("/health").json()
    assert after["kv_cache"] == before and after["running"] == after["waiting"] == 0  # nothing prefilled or kept
    assert 'status="200"} 1.0' in metric(picky, "epd_decoder_requests_total")


@pytest.mark.parametrize("ec_shm", ["auto", "off"])
def test_ec_shm_off_keeps_a_decode_workers_k_v_fetches_on_zeromq(tiny_model_dirs: dict[str, Path], ec_shm: str) -> None:
    app = create_app(DecoderConfig(max_num_seqs=2, role="decode", max_model_len=256, ec_shm=ec_shm),
                     lm=LanguageHalf(tiny_model_dirs["qwen2_vl"]))
    with TestClient(app):
        assert app.state.decoder.handoff.client._peers.enabled is (ec_shm == "auto")
