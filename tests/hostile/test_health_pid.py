"""A worker's /health is open to probes, but its process id is for the fleet's own tools: only a caller with the
internal key sees `pid` (the proxy's /health: tests/proxy/test_app.py)."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from connector.tensors.producer import ECProducer
from decoder_service.config import DecoderConfig
from decoder_service.server import create_app as decoder_app
from encoder_service.config import EncoderConfig
from encoder_service.server import create_app as encoder_app
from encoder_service.worker import EncoderWorker
from epd_models.halves import LanguageHalf, VisionHalf

KEY = "health-internal-key"
CALLERS = {"no key": {}, "wrong key": {"Authorization": f"Bearer {KEY}x"}, "api-style key": {"Authorization": KEY}}


def encoder(model_dir: Path, internal_key: str | None) -> TestClient:
    worker = EncoderWorker(VisionHalf(model_dir), ECProducer().start())
    return TestClient(encoder_app(EncoderConfig(internal_key=internal_key, insecure=internal_key is None), worker))


def decoder(model_dir: Path, internal_key: str | None) -> TestClient:
    cfg = DecoderConfig(max_num_seqs=2, max_model_len=256, internal_key=internal_key, insecure=internal_key is None)
    return TestClient(decoder_app(cfg, lm=LanguageHalf(model_dir)))


@pytest.fixture(scope="module", params=["encoder", "decoder"])
def worker(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, Path]) -> Iterator[TestClient]:
    make = encoder if request.param == "encoder" else decoder
    with make(tiny_model_dirs["qwen2_vl"], KEY) as client:
        yield client


def test_only_the_internal_key_shows_the_workers_pid(worker: TestClient) -> None:
    for headers in CALLERS.values():
        body = worker.get("/health", headers=headers).json()
        assert body["status"] == "ok" and "pid" not in body
    assert worker.get("/health", headers={"Authorization": f"Bearer {KEY}"}).json()["pid"] == os.getpid()


@pytest.mark.parametrize("make", [encoder, decoder])
def test_a_worker_without_an_internal_key_shows_its_pid_to_nobody(make: object,
                                                                  tiny_model_dirs: dict[str, Path]) -> None:
    with make(tiny_model_dirs["qwen2_vl"], None) as client:  # type: ignore[operator]
        for headers in [*CALLERS.values(), {"Authorization": "Bearer "}]:
            assert "pid" not in client.get("/health", headers=headers).json()
