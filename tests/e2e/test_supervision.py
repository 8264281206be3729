"""The launcher on the demo model (1 encoder, 1 decoder): secure by default (keys per start, in the environment
only) and supervised (a worker killed with SIGKILL is restarted and serves again). One stack for the module."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from connector.control.security import load_curve_config
from connector.tensors.consumer import ECConsumer
from epd_contracts.hashing import mm_hash
from tests.e2e.stack import Stack, ask_colour, demo_png, environ, health, launched, pid_alive, urls_of

pytestmark = pytest.mark.e2e
BACK_WITHIN_S = 120.0  # deadline for a killed worker to serve again (measured: see the report in the log)
ZMQ_REFUSED_S = 2.0  # an unauthenticated ZeroMQ request gets no answer within this (it is dropped)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # a clean environment: no key or waiver inherited from the caller
    env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("EPD_")}
    try:
        with launched(tmp_path_factory.mktemp("supervision"), "--model", "demo", "--num-encoders", "1",
                      "--num-decoders", "1", "--health-interval", "0.5", "--restart-backoff", "0.5") as s:
            yield s
    finally:
        os.environ.update(env)


def worker_pids(stack: Stack) -> dict[str, int]:
    return {role: stack.worker_pid(urls_of(stack, f"{role}s")[0]) for role in ("encoder", "decoder")}


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def poll(what: str, check: Callable[[], bool], deadline_s: float) -> float:
    """Seconds until `check()` holds (polled; fails past the deadline)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < deadline_s, f"{what} not within {deadline_s}s"
        time.sleep(0.2)
    return time.monotonic() - start


def answers(stack: Stack, colour: str, seed: int) -> bool:
    try:
        resp = ask_colour(stack.base_url, demo_png(colour, seed))
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and colour in resp.json()["choices"][0]["message"]["content"]


def test_keys_are_generated_per_start_and_never_on_argv(stack: Stack) -> None:
    pids = worker_pids(stack)
    envs = {role: environ(pid) for role, pid in pids.items()}
    key = envs["decoder"]["EPD_INTERNAL_KEY"]
    assert key and envs["encoder"]["EPD_INTERNAL_KEY"] == key
    assert envs["encoder"]["EPD_EC_CURVE_ALLOWED_CLIENTS"] and envs["decoder"]["EPD_EC_CURVE_SERVER_KEY"]
    secrets = [key, envs["encoder"]["EPD_EC_CURVE_SECRET_KEY"], envs["decoder"]["EPD_EC_CURVE_SECRET_KEY"]]
    for pid in [stack.proc.pid, *pids.values()]:
        assert not any(s in cmdline(pid) for s in secrets), f"a key is on the argv of pid {pid}"
    assert not any(s in stack.log.read_text() for s in secrets)  # and never logged


def test_workers_refuse_calls_without_the_internal_key(stack: Stack) -> None:
    enc, dec = urls_of(stack, "encoders")[0], urls_of(stack, "decoders")[0]
    encode = httpx.post(f"{enc}/encode", json={"items": []}, timeout=30)
    generate = httpx.post(f"{dec}/generate", json={"messages": [], "images": []}, timeout=30)
    assert (encode.status_code, generate.status_code) == (401, 401)
    assert encode.json()["error"]["code"] == generate.json()["error"]["code"] == "invalid_api_key"
    assert answers(stack, "red", 1)  # the normal path (the proxy has the key) answers


def test_a_zeromq_client_without_keys_gets_nothing_from_an_encoder(stack: Stack) -> None:
    image = demo_png("blue", 2)
    assert answers(stack, "blue", 2)
    address = health(urls_of(stack, "encoders")[0])["ec_address"]
    stranger = ECConsumer(cache_bytes=0)
    try:
        assert stranger.snapshot(address, timeout=ZMQ_REFUSED_S) is None
        assert stranger.ping(address, timeout=ZMQ_REFUSED_S) is False
    finally:
        stranger.close()
    # the decoder's keys (its environment) do get an answer, holding the picture just asked about
    curve = load_curve_config(None, env=environ(worker_pids(stack)["decoder"]))
    insider = ECConsumer(cache_bytes=0, curve=curve)
    try:
        snap = insider.snapshot(address, timeout=30)
    finally:
        insider.close()
    assert snap is not None and mm_hash(image) in snap.hashes


def test_ready_and_health_while_serving(stack: Stack) -> None:
    assert stack.get("/ready").status_code == 200 and stack.get("/health").status_code == 200


@pytest.mark.parametrize("role", ["decoder", "encoder"])
def test_a_killed_worker_is_restarted_and_serves_again(stack: Stack, role: str) -> None:
    old = worker_pids(stack)[role]
    os.kill(old, signal.SIGKILL)
    start = time.monotonic()
    poll(f"{role} pid {old} gone", lambda: not pid_alive(old), 30)
    seconds = poll(f"{role} serving again", lambda: answers(stack, "green", 100 + old % 1000), BACK_WITHIN_S)
    print(f"\n{role} killed with SIGKILL served again after {time.monotonic() - start:.1f} s ({seconds:.1f} s polling)")
    assert worker_pids(stack)[role] != old
    log = stack.log.read_text()
    assert f"exited with code {-signal.SIGKILL}" in log and f"restarted {role}" in log
    assert stack.get("/ready").status_code == 200
