"""Trust boundaries on a real stack: a caller cannot choose the hash an embedding is stored under, each /encode
is capped, and workers refuse to start open unless told to (and then say what is open).

One stack per module (encoder with a small --max-encode-bytes so the byte cap is cheap to hit).
"""
from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from connector.tensors.consumer import ECConsumer
from epd_contracts.hashing import mm_hash
from tests.e2e.stack import ROOT, ask_colour, demo_png
from tests.hostile.stack import HostileStack, hostile_stack, run_victims

pytestmark = pytest.mark.e2e

MAX_ENCODE_BYTES = 4 << 20  # the stack's encoder cap (its default is 320 MiB)
ENCODER_GROWTH_BOUND = 96 << 20  # encoder RSS may grow at most this much across the hostile calls
EXIT_TIMEOUT_S = 120  # an argument error exits before any model is loaded; this only bounds a hang


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileStack]:
    with hostile_stack(tmp_path_factory.mktemp("trust"), encoder_args=["--max-encode-bytes", str(MAX_ENCODE_BYTES)]) as s:
        yield s


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def encode(stack: HostileStack, items: list[dict[str, str]], key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{stack.urls['encoder']}/encode", json={"items": items}, headers=headers, timeout=60)


def answer(stack: HostileStack, image: bytes) -> str:
    resp = ask_colour(stack.base_url, image)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"]).lower()


def test_forged_hash_cannot_poison_another_picture(stack: HostileStack) -> None:
    blue, red = demo_png("blue", 4242), demo_png("red", 4343)
    before = stack.rss()["encoder"]

    def attack() -> list[httpx.Response]:
        forged = [{"mm_hash": mm_hash(blue), "data": b64(red)}]  # red's embeddings under blue's hash
        return [encode(stack, forged, None), encode(stack, forged, stack.internal_key)]

    run = run_victims(stack.base_url, n=2, during=attack, max_tokens=32)
    run.assert_undisturbed()
    unauthenticated, keyed = run.during
    assert unauthenticated.status_code == 401  # without the internal key: not even heard
    assert keyed.status_code == 400, keyed.text  # with it (a caller past the key): still refused
    assert keyed.json()["error"]["code"] == "hash_mismatch" and keyed.json()["error"]["param"] == "items.0.mm_hash"
    assert "blue" in answer(stack, blue)  # the real hash of the picture gets the right embeddings
    held = httpx.get(f"{stack.urls['encoder']}/health", timeout=10).json()
    consumer = ECConsumer(cache_bytes=0)
    try:  # proxy and encoder use one hash definition: blue is held under epd_contracts.hashing's hash of its bytes
        assert consumer.query(held["ec_address"], [mm_hash(blue)]) == [True]
    finally:
        consumer.close()
    assert stack.rss()["encoder"] - before < ENCODER_GROWTH_BOUND
    assert not stack.dead() and "red" in stack.answers_red()


def test_encode_caps_items_and_bytes(stack: HostileStack) -> None:
    before = stack.rss()["encoder"]
    tiny = demo_png("green", 5)

    def attack() -> list[httpx.Response]:
        too_many = [{"data": b64(tiny)}] * 65  # default --max-items-per-request is 64
        too_big = [{"data": b64(os.urandom(MAX_ENCODE_BYTES // 2))} for _ in range(3)]  # 6 MiB decoded
        return [encode(stack, too_many, stack.internal_key), encode(stack, too_big, stack.internal_key)]

    run = run_victims(stack.base_url, n=2, during=attack, max_tokens=32)
    run.assert_undisturbed()
    many, big = run.during
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_items"
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert stack.rss()["encoder"] - before < ENCODER_GROWTH_BOUND
    assert not stack.dead() and "red" in stack.answers_red()


def test_insecure_worker_logs_what_is_open_and_never_the_key(stack: HostileStack) -> None:
    log = stack.logs["encoder"].read_text(errors="replace")
    assert "INSECURE encoder (--insecure)" in log and "CURVE secret key" in log and "get every embedding" in log
    assert "internal key" not in log.split("INSECURE", 1)[1].split("\n", 1)[0]  # the stack sets one: not a gap
    assert stack.internal_key not in log and stack.internal_key not in stack.logs["decoder"].read_text(errors="replace")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_encoder_process_refuses_to_start_open() -> None:
    proc = subprocess.run([sys.executable, "-m", "encoder_service.cli", "--model", "demo"], capture_output=True,
                          text=True, env=clean_env(), cwd=ROOT, timeout=EXIT_TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to start without an internal key" in proc.stderr and "--insecure" in proc.stderr
    assert "CURVE secret key" in proc.stderr and "client keys allowed in" in proc.stderr


def test_decoder_refuses_to_start_open(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from decoder_service.cli import parse_args

    for var in [v for v in os.environ if v.startswith("EPD_")]:
        monkeypatch.delenv(var)
    with pytest.raises(SystemExit) as info:
        parse_args([])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "refusing to start without an internal key" in err
    assert "CURVE secret key" in err and "encoders' CURVE public key" in err and "--insecure" in err


def test_aggregated_decoder_needs_only_the_internal_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from decoder_service.cli import parse_args

    for var in [v for v in os.environ if v.startswith("EPD_")]:
        monkeypatch.delenv(var)
    with pytest.raises(SystemExit):
        parse_args(["--aggregated"])
    monkeypatch.setenv("EPD_INTERNAL_KEY", "k" * 32)  # no ZeroMQ peers: no CURVE keys needed
    cfg = parse_args(["--aggregated"])
    assert cfg.aggregated and not cfg.insecure and cfg.curve is None
