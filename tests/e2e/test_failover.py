"""Failover end to end: kill -9 of an encoder or a decoder under load, dynamic registration, the internal key."""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Any

import httpx
import pytest

from tests.e2e.stack import ask_colour, demo_png, metric, start, stop, wait_healthy
from tests.ports import PortHolds

pytestmark = pytest.mark.e2e
KEY = "internal-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COLOURS = ("red", "green", "blue")


@dataclass
class Cluster:
    tmp: Path
    encoders: list[tuple[str, Popen[bytes]]] = field(default_factory=list)
    decoders: list[tuple[str, Popen[bytes]]] = field(default_factory=list)
    procs: list[Popen[bytes]] = field(default_factory=list)
    holds: PortHolds = field(default_factory=PortHolds)  # every process's port, held for its life

    def proxy(self, *args: str) -> str:
        port = self.holds.take()
        log = self.tmp / f"proxy-{port}.log"
        proc = start("epd_launcher.cli", ["--port", str(port), "--internal-key", KEY, "--health-interval", "30", *args],
                     log, held=True)
        self.procs.append(proc)
        wait_healthy(f"http://127.0.0.1:{port}", proc, log)
        return f"http://127.0.0.1:{port}"

    def attach_args(self) -> list[str]:
        """The live workers (a killed one would keep the proxy from starting)."""
        return ["--encode-servers-urls", *(u for u, p in self.encoders if p.poll() is None),
                "--decode-servers-urls", *(u for u, p in self.decoders if p.poll() is None)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two encoders and two decoders on loopback, each requiring the internal key. Shared by the tests below
    (start-up is the slow part): the kill tests run last and each leaves one worker of its role alive."""
    tmp_path = tmp_path_factory.mktemp("failover")
    c = Cluster(tmp_path)
    try:
        for role, module, extra in (("enc", "encoder_service.cli", ["--ec-bind", "tcp://127.0.0.1:0"]),
                                    ("dec", "decoder_service.cli", ["--gather-timeout", "3"])):
            for i in range(2):
                port = c.holds.take()
                log = tmp_path / f"{role}{i}.log"
                proc = start(module, ["--port", str(port), "--internal-key", KEY, *extra], log, held=True)
                c.procs.append(proc)
                (c.encoders if role == "enc" else c.decoders).append((f"http://127.0.0.1:{port}", proc))
        for url, proc in c.encoders + c.decoders:
            wait_healthy(url, proc, tmp_path / "unused.log")
        yield c
    finally:
        for proc in reversed(c.procs):
            stop(proc)
        c.holds.close()


def instances(proxy: str) -> dict[str, Any]:
    resp = httpx.get(f"{proxy}/instances", headers=AUTH, timeout=10)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def healthy(proxy: str, role: str) -> dict[str, bool]:
    return {w["url"]: w["healthy"] for w in instances(proxy)[f"{role}s"]}


def ask(proxy: str, colour: str, seeds: range) -> httpx.Response:
    return ask_colour(proxy, *(demo_png(colour, s) for s in seeds))


def test_workers_refuse_calls_without_the_internal_key(cluster: Cluster) -> None:
    enc, dec = cluster.encoders[0][0], cluster.decoders[0][0]
    for url in (f"{enc}/encode", f"{dec}/generate"):
        resp = httpx.post(url, json={}, timeout=10)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{enc}/health", timeout=10).status_code == 200  # probes stay open


def test_workers_registered_at_run_time_take_traffic(cluster: Cluster) -> None:
    proxy = cluster.proxy("--dynamic-registration")
    assert instances(proxy) == {"encoders": [], "decoders": [], "prefills": []}
    assert ask(proxy, "red", range(3000, 3001)).status_code == 503  # nobody to do the work yet
    body = {"role": "encoder", "url": cluster.encoders[1][0]}
    assert httpx.post(f"{proxy}/instances", json=body, timeout=10).status_code == 401  # the key is required
    for role, workers in (("encoder", cluster.encoders), ("decoder", cluster.decoders)):
        for url, _ in workers:
            resp = httpx.post(f"{proxy}/instances", json={"role": role, "url": url}, headers=AUTH, timeout=10)
            assert resp.status_code == 201 and resp.json()["healthy"] is True, resp.text
    resp = ask(proxy, "green", range(3001, 3005))
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "green"
    gone = cluster.encoders[0][0]
    resp = httpx.request("DELETE", f"{proxy}/instances", json={"role": "encoder", "url": gone}, headers=AUTH,
                         timeout=10)
    assert resp.status_code == 200 and gone not in healthy(proxy, "encoder")
    before = httpx.get(f"{gone}/health", timeout=10).json()["num_encoded"]
    assert ask(proxy, "blue", range(3005, 3009)).status_code == 200
    assert httpx.get(f"{gone}/health", timeout=10).json()["num_encoded"] == before  # no work after removal
    resp = httpx.request("DELETE", f"{proxy}/instances", json={"role": "encoder", "url": gone}, headers=AUTH,
                         timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


def test_a_decoder_killed_before_the_first_token_is_replaced(cluster: Cluster) -> None:
    proxy = cluster.proxy(*cluster.attach_args())
    victim_url, victim = cluster.decoders[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    # probes run every 30 s here, so the proxy still routes to the dead decoder until a call fails
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda i: (ask(proxy, COLOURS[i % 3], range(2000 + i, 2001 + i)), COLOURS[i % 3]),
                                range(4)))
    for resp, colour in results:
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == colour
    assert healthy(proxy, "decoder") == {victim_url: False, cluster.decoders[1][0]: True}
    # the encoder test below runs on the survivors
    assert metric(httpx.get(f"{proxy}/metrics", timeout=10).text, 'epd_proxy_failovers_total{role="decoder"}') >= 1


def test_kill_9_of_an_encoder_during_20_multi_image_requests(cluster: Cluster) -> None:
    proxy = cluster.proxy(*cluster.attach_args())
    victim_url, victim = cluster.encoders[0]
    with ThreadPoolExecutor(max_workers=20) as pool:
        futures = {pool.submit(ask, proxy, COLOURS[i % 3], range(1000 + 3 * i, 1003 + 3 * i)): COLOURS[i % 3]
                   for i in range(20)}
        done = as_completed(futures)
        first = next(done)
        os.kill(victim.pid, signal.SIGKILL)  # the other 19 are still in flight or queued
        results = [(first.result(), futures[first])] + [(f.result(), futures[f]) for f in done]
    # one more request, its six new images spread over the encoders the proxy still counts healthy: if the 20 had
    # all been encoded before the kill (a busy machine), this is the call that finds the victim dead and fails over
    results.append((ask(proxy, "red", range(4000, 4006)), "red"))
    for resp, colour in results:
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == colour
    assert healthy(proxy, "encoder") == {victim_url: False, cluster.encoders[1][0]: True}
    proxy_metrics = httpx.get(f"{proxy}/metrics", timeout=10).text
    assert metric(proxy_metrics, "epd_proxy_workers_marked_down_total") == 1
    assert metric(proxy_metrics, 'epd_proxy_requests_total{endpoint="/v1/chat/completions",status="200"}') == 21
    assert metric(proxy_metrics, "epd_proxy_generation_tokens_total") > 0
