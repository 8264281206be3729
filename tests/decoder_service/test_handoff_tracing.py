"""Traces of E -> P -> D between two decoder workers (in one process, tracing on in memory): the prefill worker's
`prefill` span has a `prefill_chunk` event per chunk its prompt was prefilled in, the decode worker's fetch of the
blocks is a `kv.get` span of its `/generate` (bytes, transport), and the prefill worker's K/V server answers it in
a `kv.serve` span, its child through the get's traceparent. (The cross-process trace: tests/e2e/test_tracing.py.)"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from decoder_service.config import DecoderConfig
from decoder_service.server import create_app
from epd_models.halves import LanguageHalf
from tests import test_tracing_off

MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Name three colours and describe each one."}]}]
SAMPLING = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
CHUNK = 8  # tokens one step may run (--max-num-batched-tokens): the prompt is prefilled in several chunks

exported = test_tracing_off.exported  # the fixture: tracing on in this process, spans kept in memory


@pytest.fixture
def workers(tiny_model_dirs: dict[str, Path]) -> Iterator[dict[str, TestClient]]:
    lm = LanguageHalf(tiny_model_dirs["qwen2_vl"])
    clients: dict[str, TestClient] = {}
    try:
        for role in ("prefill", "decode"):
            cfg = DecoderConfig(max_num_seqs=4, role=role, max_model_len=256, kv_ttl=60, handoff_min_tokens=0,
                                max_num_batched_tokens=CHUNK, prefix_cache_bytes=0)
            clients[role] = TestClient(create_app(cfg, lm=lm)).__enter__()
        yield clients
    finally:
        for client in clients.values():
            client.__exit__(None, None, None)


def events(client: TestClient, body: dict[str, Any], traceparent: str) -> list[dict[str, Any]]:
    with client.stream("POST", "/generate", json={"messages": MESSAGES, "sampling": SAMPLING, **body},
                       headers={"traceparent": traceparent}) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line) for line in resp.iter_lines() if line]


def finished(exported: Any, names: set[str], trace: str) -> dict[str, Any]:
    """The trace's spans by name once every one of `names` has ended (a server span ends after its body is sent)."""
    def spans() -> dict[str, Any]:
        return {s.name: s for s in exported() if s.context.trace_id == int(trace, 16)}
    deadline = time.monotonic() + 10
    while not names <= set(spans()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert names <= set(spans()), sorted(spans())
    return spans()


def test_a_hand_off_traces_its_prefill_chunks_and_the_k_v_get_and_serve(
        exported: Any, workers: dict[str, TestClient]) -> None:
    prefilled_trace, trace = "ab" * 16, "cd" * 16
    first = events(workers["prefill"], {"handoff_key": "traced-1"}, f"00-{prefilled_trace}-{'1' * 16}-01")
    handoff = first[-1]["handoff"]
    prefilled = finished(exported, {"prefill", "POST /generate"}, prefilled_trace)
    prefill = prefilled["prefill"]
    chunks = [e.attributes["epd.tokens"] for e in prefill.events if e.name == "prefill_chunk"]
    assert len(chunks) > 1 and all(0 < n <= CHUNK for n in chunks)
    assert sum(chunks) == prefill.attributes["epd.prompt_tokens"] == handoff["num_tokens"]
    assert prefill.attributes["epd.chunks"] == len(chunks)

    events(workers["decode"], {"handoff": handoff}, f"00-{trace}-{'2' * 16}-01")  # a trace of its own: one span each
    spans = finished(exported, {"kv.get", "kv.serve", "resume", "POST /generate"}, trace)
    get, serve, generate = spans["kv.get"], spans["kv.serve"], spans["POST /generate"]
    assert get.parent.span_id == generate.context.span_id and serve.parent.span_id == get.context.span_id
    assert get.context.trace_id == serve.context.trace_id == int(trace, 16)
    assert get.attributes["epd.bytes"] == serve.attributes["epd.bytes"] > 0
    assert get.attributes["epd.transport"] == serve.attributes["epd.transport"]
    assert get.attributes["epd.transport"] in ("shm", "socket") and serve.attributes["epd.found"] is True
    assert spans["resume"].attributes["epd.kv_received"] is True
