"""A client that disconnects mid-stream stops its sequence at the next step; the next request runs."""
from __future__ import annotations

import json
import time

import httpx

from decoder_service.engine import Engine

TEXT = [{"role": "user", "content": [{"type": "text", "text": "Describe the image."}]}]


def wait_until(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


def test_disconnect_mid_stream_aborts_the_sequence(decoder: tuple[str, dict[str, Engine]]) -> None:
    url, ref = decoder
    body = {"messages": TEXT, "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        first = json.loads(next(lines))
        assert resp.status_code == 200 and first["type"] == "delta"
    engine = ref["engine"]
    assert wait_until(lambda: engine.finished["abort"] == 1 and engine.num_running == 0)
    done = httpx.post(f"{url}/generate", json={**body, "max_tokens": 3}, timeout=30).text.splitlines()
    assert json.loads(done[-1])["finish_reason"] == "length" and engine.finished["length"] == 1
