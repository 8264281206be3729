"""Media a model does not take: an image (or a video) sent to an audio-only model is a 400 with an
OpenAI error body before anything is fetched, probed or encoded, as audio to an image model is; the workers say
what the model takes in /health `model_identity` ("image": false for Qwen2-Audio and Phi-4-multimodal)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from epd_builders.audio_tiny import AudioTinySpec, build_audio_tiny
from epd_contracts.audio import AudioConfig
from epd_models.identity import model_identity
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.image import fleet_takes_images
from tests.openai_schema import assert_valid
from tests.proxy.fake_decoder import IDENTITY, FakeDecoder
from tests.proxy.media_helpers import PNG, CountingServer, as_data_url, connections_made, running, serve
from tests.proxy.test_audio_request import WAV, input_audio

AUDIO_ONLY = {**IDENTITY, "family": "qwen2_audio", "image": False, "video": None,
              "audio": AudioConfig(sample_rate=16_000, max_seconds=30.0).as_dict()}
QUESTION = {"type": "text", "text": "What is this?"}


@pytest.fixture
def server() -> Iterator[CountingServer]:
    """A loopback HTTP server that records every connection and request."""
    with running(CountingServer()) as srv:
        yield srv


@pytest.fixture
def decoder() -> Iterator[FakeDecoder]:
    fake = FakeDecoder(identity=AUDIO_ONLY)
    yield fake
    fake.close()


@pytest.fixture
def proxy(decoder: FakeDecoder) -> Iterator[TestClient]:
    """The proxy (aggregated) in front of an audio-only decoder; loopback media hosts allowed, so a fetch would
    connect to `server`."""
    cfg = ProxyConfig(encode_urls=(), decode_urls=(decoder.url,), aggregated=True, startup_timeout=10.0,
                      allowed_media_domains=("127.0.0.1",))
    with TestClient(create_app(cfg)) as client:
        yield client


def chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": [*parts, QUESTION]}], "max_tokens": 3}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def refused(resp: Any, param: str, code: str) -> str:
    assert resp.status_code == 400, resp.text
    assert_valid("ErrorResponse", resp.json())
    error = resp.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    return str(error["message"])


def test_an_image_to_an_audio_only_model_is_a_400_before_anything_is_fetched(
        proxy: TestClient, decoder: FakeDecoder, server: CountingServer) -> None:
    server.routes["/i.png"] = serve(PNG)
    server.routes["/a.wav"] = serve(WAV, "audio/wav")
    server.routes["/v.mp4"] = serve(b"\0" * 64, "video/mp4")
    audio = {"type": "audio_url", "audio_url": {"url": server.url("/a.wav")}}
    video = {"type": "video_url", "video_url": {"url": server.url("/v.mp4")}}
    for parts, param, code in [
            ((image(server.url("/i.png")),), "messages.0.content.0", "image_not_supported"),
            ((audio, image(server.url("/i.png"))), "messages.0.content.1", "image_not_supported"),
            ((input_audio(), image(as_data_url(PNG)), image(server.url("/i.png"))), "messages.0.content.1",
             "image_not_supported"),
            ((audio, video), "messages.0.content.1", "video_not_supported")]:
        message = refused(proxy.post("/v1/chat/completions", json=chat(*parts)), param, code)
        assert "does not take" in message
    assert connections_made(server) == 0 and server.paths() == ["/__sync__"]  # no image, video or clip fetched
    assert not decoder.bodies  # nothing reached a worker
    resp = proxy.post("/v1/chat/completions", json=chat(audio))  # the same clip alone is fetched and answered
    assert resp.status_code == 200, resp.text
    assert server.paths()[-1] == "/a.wav"


def test_the_fleet_takes_images_unless_its_identity_says_it_does_not() -> None:
    assert fleet_takes_images(None) and fleet_takes_images(IDENTITY)  # an older worker: as before
    assert fleet_takes_images({**IDENTITY, "image": True})
    assert not fleet_takes_images(AUDIO_ONLY)


def test_workers_report_whether_their_family_takes_images(tmp_path: Path,
                                                          tiny_model_dirs: dict[str, Path]) -> None:
    """The audio-only family says "image": false in its identity; an image family and Qwen2.5-Omni say true."""
    audio_only = build_audio_tiny(AudioTinySpec(family="qwen2_audio"), tmp_path / "qwen2_audio")
    assert model_identity(audio_only)["image"] is False
    assert model_identity(tiny_model_dirs["llava"])["image"] is True
