"""The encoder's HTTP front: it hashes the bytes itself, caps each call, and one call's failure is that call's own."""
from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import encoder_service.server as server
from connector.tensors.producer import ECProducer
from encoder_service.cli import parse_args
from encoder_service.config import EncoderConfig
from encoder_service.server import create_app
from encoder_service.worker import EncoderWorker
from epd_contracts.hashing import mm_hash
from epd_models.halves import VisionHalf
from epd_models.identity import model_identity
from tests.factories import make_image


def png(color: str, size: int = 64) -> bytes:
    buf = io.BytesIO()
    make_image(size, size, color).save(buf, format="PNG")
    return buf.getvalue()


def item(data: bytes, h: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"data": base64.b64encode(data).decode()}
    if h is not None:
        body["mm_hash"] = h
    return body


@pytest.fixture(scope="module")
def vision(tiny_model_dirs: dict[str, Path]) -> VisionHalf:
    return VisionHalf(tiny_model_dirs["qwen2_vl"])


@pytest.fixture
def client(vision: VisionHalf) -> Iterator[tuple[TestClient, EncoderWorker]]:
    producer = ECProducer().start()
    worker = EncoderWorker(vision, producer)
    cfg = EncoderConfig(max_items_per_request=3, max_encode_bytes=64 << 10, insecure=True)
    with TestClient(create_app(cfg, worker)) as c:
        yield c, worker  # the app closes the producer at shutdown


def test_forged_hash_gets_400_and_nothing_is_stored_under_it(client: tuple[TestClient, EncoderWorker]) -> None:
    c, w = client
    red, blue = png("red"), png("blue")
    resp = c.post("/encode", json={"items": [item(red, mm_hash(blue))]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "hash_mismatch"
    assert resp.json()["error"]["param"] == "items.0.mm_hash"
    assert not w.producer.has_cache_item(mm_hash(blue)) and not w.producer.has_cache_item(mm_hash(red))
    ok = c.post("/encode", json={"items": [item(red, mm_hash(red)), item(blue)]})  # hash optional
    assert ok.status_code == 200, ok.text
    assert [i["mm_hash"] for i in ok.json()["items"]] == [mm_hash(red), mm_hash(blue)]
    assert w.producer.has_cache_item(mm_hash(red)) and w.producer.has_cache_item(mm_hash(blue))


def test_caps_on_items_and_bytes(client: tuple[TestClient, EncoderWorker]) -> None:
    c, w = client
    resp = c.post("/encode", json={"items": [item(png("red"))] * 4})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "too_many_items"
    big = {"items": [item(b"\0" * (40 << 10)), item(b"\1" * (40 << 10))]}  # 80 KiB decoded > 64 KiB
    resp = c.post("/encode", json=big)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert w.num_encoded == 0
    assert c.post("/encode", json={"items": [item(png("green"))]}).status_code == 200


def test_bad_image_fails_only_its_call(client: tuple[TestClient, EncoderWorker]) -> None:
    c, w = client
    resp = c.post("/encode", json={"items": [item(png("red")), item(b"not an image")]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_image"
    assert c.post("/encode", json={"items": [item(png("red"))]}).status_code == 200


def test_vision_error_is_a_500_of_that_call_and_the_executor_goes_on(
        client: tuple[TestClient, EncoderWorker], monkeypatch: pytest.MonkeyPatch) -> None:
    c, w = client
    real = w.vision.encode

    def broken(images: Any) -> Any:
        raise RuntimeError("CUDA error: device-side assert")

    failed: list[str] = []
    monkeypatch.setattr(w.vision, "encode", broken)
    monkeypatch.setattr(w.producer, "mark_failed", failed.extend)
    resp = c.post("/encode", json={"items": [item(png("red"))]})
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "encode_failed"
    assert failed == [mm_hash(png("red"))]  # gets waiting for it answer now
    monkeypatch.setattr(w.vision, "encode", real)
    ok = c.post("/encode", json={"items": [item(png("red"))]})
    assert ok.status_code == 200 and w.producer.has_cache_item(mm_hash(png("red")))


def test_health_reports_model_identity(client: tuple[TestClient, EncoderWorker], vision: VisionHalf) -> None:
    c, _ = client
    body = c.get("/health").json()
    assert body["model_identity"] == model_identity(vision.model_dir, "demo")  # served as EncoderConfig's --model
    assert body["model_identity"]["family"] == "qwen2_vl" and body["model_identity"]["served_name"] == "demo"


def test_cli_refuses_to_start_without_keys(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for var in ("EPD_INSECURE", "EPD_INTERNAL_KEY", "EPD_EC_CURVE_SECRET_KEY", "EPD_EC_CURVE_ALLOWED_CLIENTS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as info:
        parse_args([])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "refusing to start without an internal key" in err
    assert "CURVE secret key" in err and "allowed in" in err and "--insecure" in err and "epd-ec-keygen" in err
    assert parse_args(["--insecure"]).insecure
    monkeypatch.setenv("EPD_INSECURE", "1")
    assert parse_args([]).insecure


def test_cli_starts_secure_with_keys_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import zmq

    public, secret = zmq.curve_keypair()
    client_public, _ = zmq.curve_keypair()
    monkeypatch.delenv("EPD_INSECURE", raising=False)
    monkeypatch.setenv("EPD_INTERNAL_KEY", "k" * 32)
    monkeypatch.setenv("EPD_EC_CURVE_SECRET_KEY", secret.decode())
    monkeypatch.setenv("EPD_EC_CURVE_ALLOWED_CLIENTS", client_public.decode())
    cfg = parse_args([])
    assert cfg.curve is not None and cfg.curve.allowed_clients == frozenset({client_public})
    assert cfg.internal_key == "k" * 32 and not cfg.insecure
    assert "k" * 32 not in repr(cfg)


def test_detail_low_encodes_at_the_minimum_resolution_under_its_own_hash(
        client: tuple[TestClient, EncoderWorker], vision: VisionHalf) -> None:
    """image_url.detail "low" on a dynamic-resolution family: fewer tokens (the processor's minimum pixels), stored
    under a hash of its own so a full-size request never gathers the small embeddings (or the other way round)."""
    c, w = client
    big = png("green", size=200)
    full = c.post("/encode", json={"items": [item(big)]})
    low = c.post("/encode", json={"items": [{**item(big), "detail": "low"}]})
    assert full.status_code == low.status_code == 200, (full.text, low.text)
    (f,), (lo,) = full.json()["items"], low.json()["items"]
    assert f["mm_hash"] == mm_hash(big) and lo["mm_hash"] == mm_hash(big, "low") != f["mm_hash"]
    assert not lo["cached"]  # encoded afresh, not served from the full-size entry
    least = vision.image_processor.size["shortest_edge"]
    merge = vision.config.vision_config.spatial_merge_size
    patch = vision.image_processor.patch_size
    assert lo["num_tokens"] < f["num_tokens"], (lo, f)
    assert lo["num_tokens"] * (patch * merge) ** 2 <= max(least, (patch * merge) ** 2)  # at most the minimum area
    held = w.producer.get_cache_item(mm_hash(big, "low"))
    assert held is not None and held.num_tokens == lo["num_tokens"]
    forged = c.post("/encode", json={"items": [{**item(big, mm_hash(big)), "detail": "low"}]})
    assert forged.status_code == 400 and forged.json()["error"]["code"] == "hash_mismatch"


def test_the_encode_thread_s_running_time_is_counted(client: tuple[TestClient, EncoderWorker]) -> None:
    """epd_encoder_run_seconds_total: busy time of the encode thread (the bench's frames per second per encoder)."""
    c, _ = client

    def run_seconds() -> float:
        line = next(x for x in c.get("/metrics").text.splitlines() if x.startswith("epd_encoder_run_seconds_total"))
        return float(line.split()[-1])

    before = run_seconds()
    assert c.post("/encode", json={"items": [item(png("navy"))]}).status_code == 200
    assert run_seconds() > before


def test_each_item_observes_its_share_of_the_vision_forward(client: tuple[TestClient, EncoderWorker]) -> None:
    """epd_encoder_item_encode_seconds: once per item, the forward's time over its items (their sum: the busy time)."""
    c, _ = client

    def sample(name: str) -> float:
        line = next(x for x in c.get("/metrics").text.splitlines() if x.startswith(f"{name} "))
        return float(line.split()[-1])

    names = ("epd_encoder_item_encode_seconds_count", "epd_encoder_item_encode_seconds_sum",
             "epd_encoder_run_seconds_total")
    before = [sample(n) for n in names]
    assert c.post("/encode", json={"items": [item(png("olive")), item(png("teal"))]}).status_code == 200
    count, total, busy = (sample(n) - b for n, b in zip(names, before, strict=True))
    assert count == 2 and total > 0
    assert total == pytest.approx(busy)


def test_the_worker_is_built_on_a_thread_that_is_gone_when_it_serves(tiny_model_dirs: dict[str, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the vision half leaves no OpenMP team behind for the batch thread's forwards to be throttled by
    (epd_models/torch_threads.py)."""
    built: list[threading.Thread] = []
    build = server.build_worker

    def recording(cfg: EncoderConfig) -> EncoderWorker:
        built.append(threading.current_thread())
        return build(cfg)

    monkeypatch.setattr(server, "build_worker", recording)
    cfg = EncoderConfig(model=str(tiny_model_dirs["qwen2_vl"]), insecure=True)
    with TestClient(create_app(cfg)) as c:
        assert c.get("/health").status_code == 200
        assert built[0].name == "epd-setup" and not built[0].is_alive()
