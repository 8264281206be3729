"""E -> P -> D with its only decode worker gone: a prefill worker holds the whole model, so every
request still gets its whole answer. Before, each was a 200 with one token and then `stream_interrupted`: the proxy
opened the stream on the prefill worker without knowing a decode worker could continue it.

The decode worker is killed (SIGKILL: no goodbye), and requests follow at once: the first ones find it still
marked healthy (its probes have not failed yet), are handed off, fail to reach it, and continue on the prefill
worker; the later ones run whole there from the start. Every answer is the one the stack gave before the kill,
token for token (greedy), and the prefill worker's memory stays bounded."""
from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from epd_launcher.group import reserve_port
from tests.e2e.stack import start, stop, wait_healthy
from tests.hostile.memory import rss_bytes
from tests.hostile.stack import HostileStack, StreamResult, hostile_stack, stack_env, stream_chat, victim_body

pytestmark = pytest.mark.e2e

_MAX_TOKENS = 12


class SplitStack:
    """A hostile stack whose proxy prefills on its own prefill worker (`prefill`, `prefill_url`)."""

    def __init__(self, stack: HostileStack, prefill: subprocess.Popen[bytes], prefill_url: str, prefill_log: Path):
        self.stack, self.prefill, self.prefill_url, self.prefill_log = stack, prefill, prefill_url, prefill_log


@pytest.fixture
def split(tmp_path: Path) -> Iterator[SplitStack]:
    """Encoder, decode worker (--role decode) and proxy, then a prefill worker (--role prefill, every prompt handed
    off) registered with the proxy (POST /instances): from then on every request starts there."""
    with hostile_stack(tmp_path, decoder_args=("--role", "decode")) as stack, reserve_port() as hold:
        port = hold.getsockname()[1]
        url, log = f"http://127.0.0.1:{port}", tmp_path / f"prefill-{port}.log"
        proc = start("decoder_service.cli", ["--model", "demo", "--port", str(port), "--role", "prefill",
                                             "--handoff-min-tokens", "0"], log, env=stack_env(stack.internal_key))
        try:
            wait_healthy(url, proc, log)
            added = httpx.post(f"{stack.base_url}/instances", json={"role": "prefill", "url": url}, timeout=30,
                               headers={"Authorization": f"Bearer {stack.internal_key}"})
            assert added.status_code == 201 and added.json()["healthy"], added.text
            yield SplitStack(stack, proc, url, log)
        finally:
            stop(proc)


def _ask(base_url: str, i: int) -> StreamResult:
    return stream_chat(base_url, victim_body(i, _MAX_TOKENS), timeout=60)


def _handoffs(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("epd_proxy_handoffs_total"))


def test_with_its_decode_worker_killed_every_request_is_answered_whole(split: SplitStack) -> None:
    stack = split.stack
    before = [_ask(stack.base_url, i) for i in range(4)]
    assert all(r.status == 200 and r.done and r.error is None for r in before), before
    assert _handoffs(stack.base_url) == 4  # the split is in use: each was handed off to the decode worker
    rss_before = rss_bytes(split.prefill.pid)

    stack.procs["decoder"].send_signal(signal.SIGKILL)
    stack.procs["decoder"].wait(timeout=30)
    seen = [_ask(stack.base_url, i % 4) for i in range(16)]  # the first ones before the proxy notices

    failed = [(i, r) for i, r in enumerate(seen) if not (r.status == 200 and r.done and r.error is None)]
    assert not failed, f"{len(seen) - len(failed)} of {len(seen)} succeeded; failures: {failed[:3]}"
    for i, r in enumerate(seen):  # the answer it gave with the decode worker, token for token
        alone = before[i % 4]
        assert (r.text, r.completion_tokens, r.finish_reason) == (alone.text, alone.completion_tokens,
                                                                  alone.finish_reason)
    assert split.prefill.poll() is None
    assert rss_bytes(split.prefill.pid) < rss_before + (256 << 20)
    ready = httpx.get(f"{stack.base_url}/ready", timeout=30)
    assert ready.status_code == 200, ready.text  # a prefill worker can serve the requests: the proxy is ready


def test_with_no_generator_left_a_request_is_a_503_before_any_byte(split: SplitStack) -> None:
    stack = split.stack
    for proc in (stack.procs["decoder"], split.prefill):
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    for i in range(3):  # the first finds both still marked healthy: each fails before its first event
        seen = _ask(stack.base_url, i)
        assert seen.status == 503 and seen.error is not None, seen
        assert seen.error["error"]["code"] in ("decoder_unavailable", "prefill_unavailable"), seen
