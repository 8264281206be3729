"""The launcher with --tensor-parallel-size 2 on the demo model (1 encoder, 1 decoder of two ranks, gloo on the CPU):
EPD answers as an aggregated single-process decoder does, and a rank killed with SIGKILL mid-stream takes its decoder
down within RANK_DEATH_S, the launcher restarts both ranks, the next request is answered, and no rank is left."""
from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from epd_models.demo import find_demo_model
from tests.e2e.answers import aggregated, logprobs, tokens
from tests.e2e.stack import Stack, demo_png, launched, pid_alive, urls_of
from tests.e2e.test_openai_api import SCHEMAS
from tests.e2e.test_supervision import answers, poll

pytestmark = pytest.mark.e2e
RANK_DEATH_S = 10.0  # rank 1 killed -> its decoder (rank 0) gone; measured 0.2 s (the watch thread's end of file)
COLLECTIVE_S = 15.0  # --tensor-parallel-timeout here: a hung rank ends its decoder after this
HANG_DEATH_S = COLLECTIVE_S + 15.0  # rank 1 stopped (SIGSTOP) -> rank 0 gone: the timeout, then the exit
BACK_WITHIN_S = 120.0  # the decoder's two ranks serving again
WORKER = "decoder_service.engine.tp.worker"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launched(tmp_path_factory.mktemp("tp"), "--model", "demo", "--num-encoders", "1", "--num-decoders", "1",
                  "--tensor-parallel-size", "2", "--tensor-parallel-timeout", str(COLLECTIVE_S),
                  "--health-interval", "0.5", "--restart-backoff", "0.5") as s:
        yield s


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def ranks_of(stack: Stack) -> tuple[int, list[int]]:
    """(rank 0's pid, the pids of the ranks it started)."""
    rank0 = stack.worker_pid(urls_of(stack, "decoders")[0])
    return rank0, [c for c in children(rank0) if WORKER in cmdline(c)]


def ask(base_url: str, colour: str, picture: int, **extra: Any) -> httpx.Response:
    url = "data:image/png;base64," + base64.b64encode(demo_png(colour, picture)).decode()
    body = {"model": "demo", "temperature": 0, "max_tokens": 8, "logprobs": True, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "What color is the shape?"}]}], **extra}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)


def test_epd_at_tp2_answers_as_aggregated(stack: Stack) -> None:
    asks = [("red", 1), ("blue", 2), ("green", 3)]
    got = [ask(stack.base_url, c, s).json() for c, s in asks]
    with aggregated(find_demo_model()) as url:
        want = [ask(url, c, s).json() for c, s in asks]
    assert [tokens(a) for a in got] == [tokens(a) for a in want]
    worst = max(abs(x - y) for a, b in zip(got, want, strict=True)
                for x, y in zip(logprobs(a), logprobs(b), strict=True))
    assert worst <= 1e-4, worst
    assert len(ranks_of(stack)[1]) == 1


def test_structured_output_and_n_choices_at_tp2_answer_as_aggregated(stack: Stack) -> None:
    schema = SCHEMAS[0]
    extra = {"max_tokens": 60, "n": 2, "temperature": 0.8, "seed": 5, "logprobs": False,
             "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}}
    got = ask(stack.base_url, "blue", 4, **extra).json()
    with aggregated(find_demo_model()) as url:
        want = ask(url, "blue", 4, **extra).json()
    texts = [c["message"]["content"] for c in got["choices"]]
    assert texts == [c["message"]["content"] for c in want["choices"]] and len(texts) == 2
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def stream_until_started(stack: Stack) -> tuple[threading.Thread, list[str]]:
    """A long greedy stream in a thread, returned once its first chunk arrived; `ended` gets how it ended."""
    ended: list[str] = []
    streaming = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=120, json={
                    "model": "demo", "stream": True, "max_tokens": 2000, "ignore_eos": True, "temperature": 0,
                    "messages": [{"role": "user", "content": "count"}]}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        streaming.set()
                ended.append("closed")
        except httpx.HTTPError as exc:
            ended.append(type(exc).__name__)
        streaming.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert streaming.wait(60) and not ended, "the stream did not start"
    return reader, ended


@pytest.mark.parametrize(("sig", "bound_s"), [(signal.SIGKILL, RANK_DEATH_S), (signal.SIGSTOP, HANG_DEATH_S)],
                         ids=["killed", "hung"])
def test_rank_1_killed_or_hung_mid_stream_restarts_both_ranks(stack: Stack, sig: signal.Signals,
                                                                bound_s: float) -> None:
    rank0, (rank1,) = ranks_of(stack)
    reader, ended = stream_until_started(stack)
    os.kill(rank1, sig)
    start = time.monotonic()
    gone = poll(f"rank 0 (pid {rank0})", lambda: not pid_alive(rank0), bound_s)
    print(f"\nrank 1 {sig.name}: rank 0 gone after {gone:.2f} s")
    reader.join(60)
    assert ended, "the in-flight stream never ended"
    poll("the decoder serving again", lambda: answers(stack, "green", 7 + sig), BACK_WITHIN_S)
    print(f"served again {time.monotonic() - start:.1f} s after the {sig.name}")
    new0, new_ranks = ranks_of(stack)
    assert new0 != rank0 and len(new_ranks) == 1 and new_ranks[0] != rank1
    assert not pid_alive(rank0) and not pid_alive(rank1)  # the stopped rank too: rank 0 killed it on its way out
    log = stack.log.read_text()
    why = f"tensor parallelism: rank 1 (pid {rank1}) exited" if sig == signal.SIGKILL else \
        f"Timed out waiting {int(COLLECTIVE_S * 1000)}ms"  # gloo's words for a collective past its timeout
    assert f"restarted decoder at {urls_of(stack, 'decoders')[0]}: pid={new0}" in log and why in log


def test_no_rank_is_left_after_the_launcher_stops(tmp_path: Path) -> None:
    with launched(tmp_path, "--model", "demo", "--num-encoders", "1", "--num-decoders", "1",
                  "--tensor-parallel-size", "2") as s:
        rank0, ranks = ranks_of(s)
        assert len(ranks) == 1
    poll("every rank gone", lambda: not any(pid_alive(p) for p in (rank0, *ranks)), 30)
