"""Grammar compiles cannot starve the decoder, on a decoder served in process.

The attack: many constrained requests whose schemas take long to compile, each dropped by its client. Before,
compiles ran on the threads that prepare every request, so an ordinary request's preparation queued behind them
(143.9 s to its first token, measured). Here the compiles are test doubles held on an Event (no timing): the
ordinary request completes while every one of them is still held, and the compiles of clients that left while
queued never run. The schema of the real attack gets a 400 naming it instead of a compile of seconds.
"""
from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from decoder_service.config import DecoderConfig
from decoder_service.grammar import CompiledGuide, GuideCompiler
from decoder_service.state import DecoderState
from epd_models.guide_spec import GuideSpec
from epd_models.halves import LanguageHalf
from tests.decoder_service.conftest import served
from tests.decoder_service.engine_run import wait_until

TEXT = [{"role": "user", "content": [{"type": "text", "text": "Describe the image."}]}]
HOSTILE = {"type": "object", "patternProperties": {f"^tag{i}(a|b)*c$": {"type": "string"} for i in range(300)}}
# more attackers than the default thread pool has threads (min(32, cores + 4)): before, each held one
NUM_ATTACKERS = min(32, (os.cpu_count() or 1) + 4) + 2


@pytest.fixture
def decoder(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[str, DecoderState]]:
    cfg = DecoderConfig(port=0, max_num_seqs=4, grammar_compile_threads=2)
    with served(cfg, LanguageHalf(tiny_model_dirs["llava"])) as out:
        yield out


def body(schema: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": TEXT, "sampling": {"max_tokens": 4, "ignore_eos": True, "temperature": 0}}
    if schema is not None:
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    return out


def send(port: int, payload: dict[str, Any]) -> socket.socket:
    """A /generate request on a raw connection, left unread: closing the socket is the client leaving."""
    data = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: decoder\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


class HeldCompiles:
    """GuideCompiler.compile as a test double: records each compile that starts, and holds it until `release`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.started: list[GuideSpec] = []
        self.release = threading.Event()
        original = GuideCompiler.compile

        def held(compiler: GuideCompiler, spec: GuideSpec) -> CompiledGuide:
            self.started.append(spec)
            assert self.release.wait(120), "the test never released the held compiles"
            return original(compiler, spec)

        monkeypatch.setattr(GuideCompiler, "compile", held)


def test_the_attack_schema_is_a_400_naming_it(decoder: tuple[str, DecoderState]) -> None:
    """300 patternProperties keys compiled for 6.3 s (41.7 s at 500); refused before compiling."""
    url, _ = decoder
    resp = httpx.post(f"{url}/generate", json=body(HOSTILE), timeout=120)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == ("response_format", "schema_too_complex")
    assert "patternProperties" in error["message"]


def test_an_ordinary_request_is_not_queued_behind_held_compiles(decoder: tuple[str, DecoderState],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    url, state = decoder
    engine, port = state.ready_engine(), int(url.rsplit(":", 1)[1])
    held = HeldCompiles(monkeypatch)
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(NUM_ATTACKERS)]
    attackers = [send(port, body(s)) for s in schemas]  # distinct schemas: no cache hit
    try:
        assert wait_until(lambda: len(held.started) == 2 and engine.compiles.num_queued == NUM_ATTACKERS - 2, 60)

        ordinary = httpx.post(f"{url}/generate", json=body(), timeout=120)  # no grammar

        assert ordinary.status_code == 200, ordinary.text
        events = [json.loads(line) for line in ordinary.text.splitlines() if line]  # empty: a keep-alive
        assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "length"
        assert len(held.started) == 2 and not held.release.is_set()  # it finished while both were held
        # the queued attackers leave first (a slot freed meanwhile would start the next one): none of theirs runs
        running = {int(next(iter(json.loads(spec.schema)["properties"]))[1:]) for spec in held.started}
        for i in set(range(NUM_ATTACKERS)) - running:
            attackers[i].close()
        assert wait_until(lambda: engine.compiles.num_queued == 0, 60)
        for i in running:  # then the two whose compiles run: those finish on spare threads, holding no slot
            attackers[i].close()
        assert wait_until(lambda: (engine.compiles.num_running, engine.compiles.num_spare) == (0, 2), 60)
    finally:
        for sock in attackers:
            sock.close()
        held.release.set()
    assert wait_until(lambda: engine.compiles.num_spare == 0 and engine.num_waiting == 0, 60)
    assert len(held.started) == 2  # none of the queued ones ever ran
    after = httpx.post(f"{url}/generate", json=body({"type": "object"}), timeout=120)
    assert after.status_code == 200 and json.loads(after.text.splitlines()[-1])["type"] == "done"
