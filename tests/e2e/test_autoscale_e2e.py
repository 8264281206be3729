"""--autoscale on the demo: a burst of new images makes the launcher add an encoder; when the burst ends it drains
back to --min-encoders; no request fails on the way (the encoder taken out of the proxy first, stopped after)."""
from __future__ import annotations

import base64
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.e2e.stack import Stack, demo_png, launched, urls_of
from tests.waiting import wait_for

HANG_S = 240.0  # a hang guard for each change of the fleet (the new encoder loads the model first)


def image_request(seed: int) -> dict[str, object]:
    url = "data:image/png;base64," + base64.b64encode(demo_png("red", seed=seed)).decode()
    return {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Colour?"}]}]}


def until(stack: Stack, what: str, count: int) -> list[str]:
    """The proxy's encoders once there are `count` of them (tests/waiting.py: a hang guard, not a timing target)."""
    wait_for(lambda: len(urls_of(stack, "encoders")) == count, f"{what} (log: {stack.log})", HANG_S, interval=0.5)
    return urls_of(stack, "encoders")


def test_a_burst_adds_an_encoder_and_its_end_drains_it_with_no_failed_request(tmp_path: Path) -> None:
    args = ["--model", "demo", "--num-encoders", "1", "--num-decoders", "1", "--autoscale", "--autoscale-window", "1",
            "--max-encoders", "2", "--target-utilization", "0.15", "--down-windows", "2"]
    statuses: list[int] = []
    stop = threading.Event()
    seeds = iter(range(10 ** 6))
    lock = threading.Lock()

    def client(stack: Stack) -> None:
        while not stop.is_set():
            with lock:
                seed = next(seeds)
            resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=image_request(seed), timeout=120)
            with lock:
                statuses.append(resp.status_code)

    with launched(tmp_path, *args) as stack:
        with ThreadPoolExecutor(4) as pool:
            burst = [pool.submit(client, stack) for _ in range(4)]
            try:
                grown = until(stack, "a second encoder", 2)
            finally:
                stop.set()
            for f in burst:
                f.result()
        shrunk = until(stack, "the drain back to one encoder", 1)
        after = [httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=120, json=body).status_code
                 for body in (image_request(10 ** 7), image_request(0))]  # a new image, and one seen in the burst
        log = stack.log.read_text()
    assert statuses and set(statuses) == {200}, statuses
    assert after == [200, 200]
    assert set(shrunk) < set(grown)
    assert "autoscale: adding encoder" in log and "autoscale: retiring encoder" in log
