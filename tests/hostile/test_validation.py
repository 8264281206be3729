"""Engine-true validation, once: every hostile field value gets its own 400 naming the parameter, at the proxy
and at the decoder's /generate; values the contract admits, however extreme, run without disturbing anyone.

One in-process stack per module: the real proxy app and a real decoder (tiny LLaVA LM) served by uvicorn in
threads. Text only (no encoder needed: the proxy runs in aggregated mode, the decoder gets no images).
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from decoder_service.config import DecoderConfig
from decoder_service.server import create_app as decoder_app
from decoder_service.shell import Engine
from decoder_service.state import DecoderState
from epd_contracts.limits import (
    MAX_MESSAGES,
    MAX_MODEL_NAME_CHARS,
    MAX_NAME_CHARS,
    MAX_PARTS_PER_MESSAGE,
    MAX_TOTAL_PARTS,
)
from epd_contracts.sampling import MAX_SEED, MAX_STOP_CHARS, MAX_TOKENS, MAX_TOP_K, MIN_SEED
from epd_models.halves import LanguageHalf
from proxy.app import create_app as proxy_app
from proxy.config import ProxyConfig
from tests.hostile.memory import rss_bytes
from tests.hostile.stack import StreamResult, stream_chat
from tests.ports import serve_in_thread

MEMORY_BOUND = 64 << 20  # RSS growth of this process (proxy + decoder + client) over a hostile batch (measured: 3-10 MiB)
USER = [{"role": "user", "content": "describe the image"}]
TEXT = {"type": "text", "text": "hi"}


@dataclass
class Stack:
    proxy: str
    decoder: str
    decoder_state: DecoderState

    @property
    def engine(self) -> Engine:
        return self.decoder_state.engine


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """`app` behind uvicorn in a thread, on a socket bound before it starts (tests/ports.py)."""
    with serve_in_thread(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"), timeout=120) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def inproc(tiny_model_dirs: dict[str, Path]) -> Iterator[Stack]:
    dec = decoder_app(DecoderConfig(max_num_seqs=8), lm=LanguageHalf(tiny_model_dirs["llava"]))
    with serving(dec) as dec_url:
        cfg = ProxyConfig(encode_urls=(), decode_urls=(dec_url,), aggregated=True, served_model_name="demo")
        with serving(proxy_app(cfg)) as proxy_url:
            yield Stack(proxy_url, dec_url, dec.state.decoder)


def chat(stack: Stack, raw: bytes | None = None, **fields: Any) -> httpx.Response:
    body = raw if raw is not None else json.dumps({"model": "demo", "messages": USER, "max_tokens": 6,
                                                   "temperature": 0, **fields}).encode()
    return httpx.post(f"{stack.proxy}/v1/chat/completions", content=body, timeout=120,
                      headers={"content-type": "application/json"})


def generate(stack: Stack, body: dict[str, Any] | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{stack.decoder}/generate", content=content, timeout=120,
                      headers={"content-type": "application/json"})


def answer(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def assert_refused(resp: httpx.Response, param: str, code: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err


def many(n: int, item: Any) -> list[Any]:
    return [item] * n


# each case: (request fields, the parameter the 400 names)
OUT_OF_CONTRACT = [
    ({"seed": MAX_SEED + 1}, "seed"),  # 2**64: killed the engine thread before
    ({"seed": MIN_SEED - 1}, "seed"),
    ({"seed": 0.5}, "seed"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -1e-30}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": MAX_TOP_K + 1}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": MAX_TOKENS + 1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"stop": many(5, "x")}, "stop"),
    ({"stop": ""}, "stop.0"),
    ({"stop": ["ok", "y" * (MAX_STOP_CHARS + 1)]}, "stop.1"),
    ({"messages": many(MAX_MESSAGES + 1, USER[0])}, "messages"),
    ({"messages": [{"role": "user", "content": many(MAX_PARTS_PER_MESSAGE + 1, TEXT)}]}, "messages.0.content"),
    ({"messages": many(MAX_TOTAL_PARTS // MAX_PARTS_PER_MESSAGE + 1,
                       {"role": "user", "content": many(MAX_PARTS_PER_MESSAGE, TEXT)})}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "name": "n" * (MAX_NAME_CHARS + 1)}]}, "messages.0.name"),
    ({"model": "m" * (MAX_MODEL_NAME_CHARS + 1)}, "model"),
    ({"messages": [{"role": "function", "content": "42", "name": "f"}]}, "messages.0.role"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
                   *USER]}, "messages.0.tool_calls.0.function"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true, as OpenAI
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tool_choice": "auto"}, "tool_choice"),  # without tools
    ({"logit_bias": {"50256": -101}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages.0.content.0.input_audio.data"),  # a known part without its data
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
     "messages.0.content.0.video_url.url"),  # a known part without its url
]
NON_FINITE = [(field, text) for field in ("temperature", "top_p", "frequency_penalty", "presence_penalty")
              for text in ("NaN", "Infinity", "-Infinity")]
UNSUPPORTED = [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"best_of": 2}, "best_of"),
    ({"echo": True}, "echo"),
]
# accepted: harmless bookkeeping, or a feature field set to its "off" value
HARMLESS = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True,
            "logprobs": False, "response_format": {"type": "text"}, "tools": [],
            "tool_choice": "none", "logit_bias": {}, "min_p": 0, "n": 1, "modalities": ["text"], "no_such_field": None,
            "stream_options": None}


def test_every_out_of_contract_value_gets_its_own_400_naming_it(inproc: Stack) -> None:
    ordinary = answer(chat(inproc))
    before = rss_bytes()
    for fields, param in OUT_OF_CONTRACT:
        assert_refused(chat(inproc, **fields), param, "invalid_request")
    for field, text in NON_FINITE:  # Python's json module parses these; the contract refuses them
        raw = f'{{"model": "demo", "messages": {json.dumps(USER)}, "{field}": {text}}}'.encode()
        assert_refused(chat(inproc, raw=raw), field, "invalid_request")
    assert rss_bytes() - before < MEMORY_BOUND
    assert answer(chat(inproc)) == ordinary


def test_unimplemented_openai_fields_get_a_400_naming_them_never_a_silent_200(inproc: Stack) -> None:
    ordinary = answer(chat(inproc))
    for fields, param in UNSUPPORTED:
        resp = chat(inproc, **fields)
        assert_refused(resp, param, "unsupported_parameter")
        assert param in resp.json()["error"]["message"]
    echoed = {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None, "annotations": []}
    assert answer(chat(inproc, **HARMLESS)) == ordinary
    assert answer(chat(inproc, messages=[*USER, echoed, *USER])) != ""  # a client's echoed reply is fine


def test_decoder_generate_holds_the_same_contract(inproc: Stack) -> None:
    ok = {"messages": USER, "sampling": {"max_tokens": 3, "temperature": 0}}
    assert generate(inproc, ok).status_code == 200
    cases: list[tuple[dict[str, Any] | bytes, str]] = [
        ({**ok, "sampling": {"seed": MAX_SEED + 1}}, "sampling.seed"),
        ({**ok, "sampling": {"top_k": MAX_TOP_K + 1}}, "sampling.top_k"),
        ({**ok, "sampling": {"min_p": 1.5}}, "sampling.min_p"),
        ({**ok, "max_tokens": 3}, "max_tokens"),  # the old flat spelling: refused, not silently ignored
        ({**ok, "messages": many(MAX_MESSAGES + 1, USER[0])}, "messages"),
        ({**ok, "messages": [{"role": "user", "content": many(MAX_PARTS_PER_MESSAGE + 1, TEXT)}]}, "messages"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "sampling": {"temperature": NaN}}',
         "sampling.temperature"),
    ]
    for body, param in cases:
        assert_refused(generate(inproc, body), param, "invalid_request")
    nested = b'{"messages": [{"role": "user", "content": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    resp = generate(inproc, nested)  # deeper than the JSON decoder's recursion: its own 400, not a 500
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request", resp.text
    assert generate(inproc, ok).status_code == 200


def victim(i: int) -> dict[str, Any]:
    text = ["what is in the picture", "describe the colours"][i]
    return {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": 160, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


# admitted, however extreme: each must run (8 tokens) beside the others' streams
EXTREMES: list[dict[str, Any]] = [
    {"temperature": 1e-38},  # made sampling raise inside the batched step, ending every stream
    {"temperature": 5e-324, "top_k": MAX_TOP_K},
    {"top_p": 0.0},
    {"top_p": 1e-300, "temperature": 2},
    {"seed": MAX_SEED, "temperature": 2, "top_k": MAX_TOP_K},
    {"seed": MIN_SEED, "temperature": 2, "frequency_penalty": -2, "presence_penalty": -2},
    {"seed": -1, "temperature": 1e-5, "top_p": 1e-5, "frequency_penalty": 2, "presence_penalty": 2},
    {"stop": ["a" * MAX_STOP_CHARS, "\n", "the", "."], "temperature": 2},
]


def test_extreme_admitted_values_run_beside_other_streams_without_changing_them(inproc: Stack) -> None:
    greedy = answer(chat(inproc, max_tokens=8, ignore_eos=True))
    alone = [stream_chat(inproc.proxy, victim(i)) for i in (0, 1)]
    started = threading.Semaphore(0)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(stream_chat, inproc.proxy, victim(i), started.release) for i in (0, 1)]
        assert all(started.acquire(timeout=120) for _ in range(2)), "the other streams never started"
        before = rss_bytes()
        extremes = [chat(inproc, max_tokens=8, ignore_eos=True, **fields) for fields in EXTREMES]
        refused = generate(inproc, {"messages": USER, "sampling": {"seed": MAX_SEED + 1}})
        grown = rss_bytes() - before
        together: list[StreamResult] = [f.result(timeout=120) for f in futures]
    assert_refused(refused, "sampling.seed", "invalid_request")
    for fields, resp in zip(EXTREMES, extremes, strict=True):
        assert resp.status_code == 200, (fields, resp.text)
        done = resp.json()
        assert done["usage"]["completion_tokens"] <= 8 and done["choices"][0]["finish_reason"] in ("length", "stop")
    assert [answer(r) for r in extremes[:3]] == [greedy] * 3  # numerically zero temperature/top_p is greedy
    for a, b in zip(alone, together, strict=True):
        assert a.status == b.status == 200 and a.error is None and b.error is None and b.done
        assert (b.text, b.completion_tokens, b.finish_reason) == (a.text, a.completion_tokens, a.finish_reason)
    assert inproc.engine.scheduler.peak_running >= 3  # the extremes really ran beside the two streams
    assert grown < MEMORY_BOUND
    assert answer(chat(inproc, max_tokens=8, ignore_eos=True)) == greedy
