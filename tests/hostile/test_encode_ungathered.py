"""An encoder whose decoders do not gather what it stored refuses new work past --max-ungathered-bytes (503
encoder_busy with Retry-After: the proxy tries another encoder), still answers calls whose items it holds, and
takes work again once a decoder gathers (or the bytes age out)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from encoder_service.config import EncoderConfig
from encoder_service.server import create_app
from encoder_service.worker import EncoderWorker
from epd_common.http import REQUEST_ID_HEADER
from epd_contracts.hashing import mm_hash
from epd_models.halves import VisionHalf
from tests.encoder_service.test_server import item, png


@pytest.fixture
def encoder(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[TestClient, EncoderWorker]]:
    worker = EncoderWorker(VisionHalf(tiny_model_dirs["qwen2_vl"]), ECProducer().start())
    with TestClient(create_app(EncoderConfig(insecure=True, max_ungathered_bytes=1), worker)) as client:
        yield client, worker


def test_work_past_the_ungathered_bound_is_refused_until_a_decoder_gathers(
        encoder: tuple[TestClient, EncoderWorker]) -> None:
    client, worker = encoder
    assert client.post("/encode", json={"items": [item(png("red"))]}).status_code == 200  # nothing waited: admitted
    refused = client.post("/encode", json={"items": [item(png("blue"))]})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    err = refused.json()["error"]
    assert err["code"] == "encoder_busy" and "gather" in err["message"]
    assert not worker.producer.has_cache_item(mm_hash(png("blue")))  # nothing of it was encoded
    held = client.post("/encode", json={"items": [item(png("red"))]})  # held already: no work, answered
    assert held.status_code == 200 and held.json()["items"][0]["cached"] is True
    consumer = ECConsumer(cache_bytes=0)
    try:
        red = mm_hash(png("red"))
        consumer.gather([red], {red: worker.producer.address}, timeout=30)
    finally:
        consumer.close()
    assert worker.producer.ungathered_bytes() == 0
    assert client.post("/encode", json={"items": [item(png("blue"))]}).status_code == 200
    assert "epd_ec_ungathered_bytes" in client.get("/metrics").text


def test_a_requests_own_ungathered_items_never_refuse_its_next_call(encoder: tuple[TestClient, EncoderWorker]) -> None:
    """A request whose first items wait for its last ones (its decoder gathers them together) must not wait for
    itself: only other requests' items count (one request's two calls here, as a re-encode or a second encoder's)."""
    client, _ = encoder
    own = {REQUEST_ID_HEADER: "one-request"}
    assert client.post("/encode", json={"items": [item(png("red"))]}, headers=own).status_code == 200
    assert client.post("/encode", json={"items": [item(png("blue"))]}, headers=own).status_code == 200
    other = client.post("/encode", json={"items": [item(png("green"))]}, headers={REQUEST_ID_HEADER: "another"})
    assert other.status_code == 503 and other.json()["error"]["code"] == "encoder_busy"
