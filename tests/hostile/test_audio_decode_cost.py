"""A clip cheap to send and dear to decode: 4 MB of 16-sample FLAC frames at 384 kHz passed the
proxy's probe and then held an encoder for its whole 30 s decode budget before a 400. The probe estimates the decode's
cost from the packets it counts (epd_common/audio.py decode_cost_s) and refuses it: a 400 audio_too_large naming the
limit, nothing sent to an encoder or a decoder. The proxy app in process (EPD mode) in front of fake workers of an
audio model."""
from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from epd_common.audio_limits import DECODE_BUDGET_S
from epd_contracts.audio import AudioConfig
from tests.audio_clips import make_audio, tiny_frames_flac
from tests.openai_schema import assert_valid
from tests.proxy.fake_decoder import IDENTITY, FakeDecoder
from tests.proxy.fake_encoder import FakeEncoder
from tests.proxy.fake_stack import proxy_in_front

AUDIO_IDENTITY = {**IDENTITY, "audio": AudioConfig(sample_rate=16_000).as_dict()}


class Stack:
    def __init__(self, client: TestClient, decoder: FakeDecoder, encoder: FakeEncoder):
        self.client, self.decoder, self.encoder = client, decoder, encoder


@pytest.fixture
def stack() -> Iterator[Stack]:
    decoder, encoder = FakeDecoder(identity=AUDIO_IDENTITY), FakeEncoder(AUDIO_IDENTITY)
    with proxy_in_front(decoder, [encoder]) as client:
        yield Stack(client, decoder, encoder)


def chat(data: bytes) -> dict[str, Any]:
    url = "data:audio/flac;base64," + base64.b64encode(data).decode()
    content = [{"type": "audio_url", "audio_url": {"url": url}}, {"type": "text", "text": "What is said?"}]
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 3}


def test_a_flac_of_tiny_frames_is_refused_before_any_encoder_decodes_it(stack: Stack) -> None:
    hostile = tiny_frames_flac(245_000)  # 4.1 MB: 245,000 packets of 16 samples, 10.2 s at 384 kHz
    resp = stack.client.post("/v1/chat/completions", json=chat(hostile))
    assert resp.status_code == 400, resp.text
    assert_valid("ErrorResponse", resp.json())
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("audio_too_large", "messages.0.content.0.audio_url.url")
    assert f"more than {DECODE_BUDGET_S:g} s to decode, the limit of one clip's decode" in error["message"]
    assert "packets of 16 samples at 384000 Hz" in error["message"]
    assert not stack.encoder.items() and not stack.decoder.bodies  # nothing was sent on

    # the same 10 s at the same rate in ordinary frames is sent to the encoder and answered
    ordinary = make_audio("flac", seconds=10, rate=384_000, channels=1, silence=True, frame_size=4096)
    resp = stack.client.post("/v1/chat/completions", json=chat(ordinary))
    assert resp.status_code == 200, resp.text
    assert len(stack.encoder.items()) == 1 and len(stack.decoder.bodies) == 1
