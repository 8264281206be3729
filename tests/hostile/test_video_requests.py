"""A video request that can only fail, or would cost the encoders more than the server allows, is refused by the
proxy before any /encode: its videos' tokens are counted against the decoders' context (their /health
max_model_len), and the frames its chunks decode (each from the keyframe before it) against
--max-video-decode-frames. An encoder's refusal of a chunk names the client's field, not the /encode call's."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from epd_common.video import probe_video
from epd_common.video_index import decode_cost
from epd_common.video_sampling import VideoConfig, frame_indices, target_frames
from epd_common.video_tokens import video_rows
from tests.factories import make_video
from tests.hostile.video_clips import gop_clip
from tests.proxy.fake_decoder import IDENTITY, FakeDecoder
from tests.proxy.fake_encoder import FakeEncoder
from tests.proxy.fake_stack import proxy_in_front
from tests.proxy.media_helpers import as_data_url

# Qwen2-VL's video processor settings, with its token rule (patch 14, merge 2)
QWEN2 = VideoConfig(sampler="qwen2", temporal_patch=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                    patch_size=14, merge_size=2)
CLIP = gop_clip(600, gop=250)  # 20 s at 30 fps: 40 frames at 2 fps, keyframes at 0, 250, 500
PARAM = "messages.0.content.0.video_url.url"


def rows(config: VideoConfig = QWEN2, data: bytes = CLIP) -> int:
    info = probe_video(data)
    total = len(frame_indices(config, info, target_frames(config, info)))
    n = video_rows(config, info.width, info.height, total, config.max_pixels)
    assert n is not None
    return n


def body(**extra: Any) -> dict[str, Any]:
    content = [{"type": "video_url", "video_url": {"url": as_data_url(CLIP, "video/mp4")}},
               {"type": "text", "text": "What happens?"}]
    return {"model": "demo", "messages": [{"role": "user", "content": content}], **extra}


class Stack:
    def __init__(self, client: TestClient, decoder: FakeDecoder, encoder: FakeEncoder):
        self.client, self.decoder, self.encoder = client, decoder, encoder

    def chat(self, request: dict[str, Any]) -> httpx.Response:
        return self.client.post("/v1/chat/completions", json=request)


def stack(config: VideoConfig = QWEN2, max_model_len: int | None = None, refusal: dict[str, Any] | None = None,
          **cfg: Any) -> Iterator[Stack]:
    identity = {**IDENTITY, "family": "qwen2_vl", "video": config.as_dict()}
    decoder = FakeDecoder(identity=identity, health={"max_model_len": max_model_len} if max_model_len else {})
    encoder = FakeEncoder(identity, refusal=refusal)
    with proxy_in_front(decoder, [encoder], **cfg) as client:
        yield Stack(client, decoder, encoder)


@pytest.fixture
def short_context() -> Iterator[Stack]:
    yield from stack(max_model_len=rows())  # the video's rows alone fill it: no room for one token


def error(resp: httpx.Response) -> tuple[int, str, str]:
    err = resp.json()["error"]
    return resp.status_code, err["code"], err["param"]


def test_a_video_that_cannot_fit_the_context_is_refused_before_any_encode(short_context: Stack) -> None:
    resp = short_context.chat(body())
    assert error(resp) == (400, "context_length_exceeded", PARAM), resp.text
    assert f"at least {rows()} prompt tokens" in resp.json()["error"]["message"]
    assert short_context.encoder.calls == [] and short_context.decoder.bodies == []


def test_max_tokens_that_cannot_fit_beside_the_video_is_refused_before_any_encode() -> None:
    for s in stack(max_model_len=rows() + 10):
        assert error(s.chat(body(max_tokens=11))) == (400, "context_length_exceeded", "max_tokens")
        assert s.encoder.calls == []
        assert s.chat(body(max_tokens=10)).status_code == 200  # it may fit (the text is not counted): served
        assert s.encoder.calls != []


@pytest.mark.parametrize("config", [replace(QWEN2, patch_size=None, merge_size=None)], ids=["no-token-rule"])
def test_without_the_rule_or_the_length_nothing_is_refused(config: VideoConfig) -> None:
    for s in stack(config=config, max_model_len=8):  # workers that do not report the rule
        assert s.chat(body()).status_code == 200
    for s in stack(max_model_len=None):  # decoders that do not report their length
        assert s.chat(body()).status_code == 200


def planned_decoding(per_chunk: int, keyframes: tuple[int, ...] | None = None) -> int:
    """Frames the encoders decode for CLIP's chunks of `per_chunk` sampled frames, each from the last of
    `keyframes` (default: the clip's own) before its frames."""
    info = probe_video(CLIP)
    indices = frame_indices(QWEN2, info, target_frames(QWEN2, info))
    keys = info.keyframes if keyframes is None else keyframes
    return sum(decode_cost(indices[i:i + per_chunk], keys) for i in range(0, len(indices), per_chunk))


def test_the_decode_budget_is_a_400_naming_the_video_before_any_encode() -> None:
    assert probe_video(CLIP).keyframes == (0, 250, 500)
    cost = planned_decoding(4)  # 40 frames in 10 chunks of 4
    assert cost < planned_decoding(4, keyframes=(0,)) * 2 // 3  # each chunk decoded from frame 0 (before): more
    for s in stack(max_video_decode_frames=cost - 1, video_chunk_frames=4):
        resp = s.chat(body())
        assert error(resp) == (400, "video_too_large", PARAM), resp.text
        assert f"take {cost} decoded frames" in resp.json()["error"]["message"] and s.encoder.calls == []
    for s in stack(max_video_decode_frames=cost, video_chunk_frames=4):
        assert s.chat(body()).status_code == 200


def test_an_encoders_refusal_of_a_chunk_names_the_clients_field() -> None:
    refusal = {"message": "a 16x4000 frame cannot be resized", "type": "invalid_request_error",
               "param": "items.0.data", "code": "invalid_video"}
    for s in stack(refusal=refusal, max_model_len=None):
        assert error(s.chat(body())) == (400, "invalid_video", PARAM)
        assert s.encoder.calls != [] and s.decoder.bodies == []


def test_a_video_too_tall_for_the_model_is_refused_by_the_proxy_naming_the_clients_field() -> None:
    tall = make_video(4, width=16, height=4000)  # an aspect ratio over 200: Qwen's resize refuses it
    for s in stack():
        content = [{"type": "video_url", "video_url": {"url": as_data_url(tall, "video/mp4")}}]
        resp = s.chat({"model": "demo", "messages": [{"role": "user", "content": content}]})
        assert error(resp) == (400, "invalid_video", PARAM) and "aspect ratio" in resp.json()["error"]["message"]
        assert s.encoder.calls == []
