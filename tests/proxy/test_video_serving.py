"""A video request through the proxy app, with fake encoders and a fake decoder on loopback: the chunks are spread
over the encoders as /encode items carrying their VideoParts, the decoder's GenerateRequest names each image and
video in prompt order (a video by its hash, its whole part and its chunks in order), aggregated mode sends the file;
a refused video is an OpenAI error body and schedules nothing. The missing-embeddings recovery re-encodes the chunks
a decoder lost (through Generation with a scripted fleet)."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
from fastapi.testclient import TestClient

from epd_common.errors import APIError
from epd_contracts.generate import GenerateRequest
from epd_contracts.sampling import SamplingParams
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.generation import Generation
from proxy.prepare import PreparedChat, prepare_chat
from proxy.protocol import ChatCompletionRequest
from proxy.video import VideoItem
from tests.openai_schema import assert_valid
from tests.proxy.fake_decoder import IDENTITY, FakeDecoder
from tests.proxy.fake_encoder import FakeEncoder
from tests.proxy.media_helpers import PNG, as_data_url, config
from tests.proxy.test_generation import DONE, FakeFleet, FakeStream
from tests.proxy.test_video_request import QWEN2, part, video_url

VIDEO_IDENTITY = {**IDENTITY, "family": "qwen2_vl", "video": QWEN2.as_dict()}
IMAGE = {"type": "image_url", "image_url": {"url": as_data_url(PNG)}}


def body(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": "What happens?"}]
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}


class Stack:
    """The proxy app in process, in front of fake workers."""

    def __init__(self, client: TestClient, decoder: FakeDecoder, encoders: list[FakeEncoder]):
        self.client, self.decoder, self.encoders = client, decoder, encoders

    def chat(self, request: dict[str, Any]) -> httpx.Response:
        return self.client.post("/v1/chat/completions", json=request)

    def encoded(self) -> list[list[dict[str, Any]]]:
        """Each encoder's /encode items, in the order it got them."""
        return [enc.items() for enc in self.encoders]


@pytest.fixture
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """EPD mode: 2 encoders, 1 decoder, chunks of 4 frames (the test clip is 8 frames at 2 fps: 2 chunks)."""
    identity = getattr(request, "param", VIDEO_IDENTITY)
    decoder = FakeDecoder(identity=identity)
    encoders = [FakeEncoder(identity) for _ in range(2)]
    cfg = ProxyConfig(encode_urls=tuple(e.url for e in encoders), decode_urls=(decoder.url,), startup_timeout=10.0,
                      video_chunk_frames=4)
    try:
        with TestClient(create_app(cfg)) as client:
            yield Stack(client, decoder, encoders)
    finally:  # at once: each server's shutdown waits for its poll interval
        closing = [threading.Thread(target=w.close) for w in (decoder, *encoders)]
        for t in closing:
            t.start()
        for t in closing:
            t.join()


def expected_video(*parts: dict[str, Any], **extra: Any) -> list[VideoItem]:
    """The videos prepare_chat plans for this request (what the proxy must have sent on)."""
    req = ChatCompletionRequest.model_validate(body(*parts, **extra))
    return [it for it in prepare_chat(req, config(video_chunk_frames=4), video=QWEN2).items
            if isinstance(it, VideoItem)]


def test_a_videos_chunks_are_spread_over_the_encoders_and_the_decoder_gets_them_in_order(stack: Stack) -> None:
    resp = stack.chat(body(IMAGE, part(video_url())))
    assert resp.status_code == 200, resp.text
    [video] = expected_video(IMAGE, part(video_url()))
    assert len(video.chunks) == 2
    sent = stack.encoded()
    assert sum(map(len, sent)) == 3  # the image and 2 chunks, each encoded once
    by_hash = {it["mm_hash"]: it for items in sent for it in items}
    # each item placed on its own (scheduler/rendezvous.py): 3 items on 2 encoders, at most ceil(1.25 * 3 / 2) = 2
    # on one, so the chunks are spread over the encoders as any items are
    assert sorted(map(len, sent)) == [1, 2]
    calls = [call for enc in stack.encoders for call in enc.calls]
    assert all(len(call) == 1 for call in calls if any("video" in it for it in call))  # a chunk per /encode call
    for chunk in video.chunks:
        item = by_hash[chunk.mm_hash]
        assert item["video"] == msgspec.to_builtins(chunk.video) and item["data"] == video_url().split(",", 1)[1]
        assert "detail" not in item and "multi_image" not in item
    generate = msgspec.convert(stack.decoder.bodies[-1], GenerateRequest)
    assert [p["type"] for p in generate.messages[0]["content"]] == ["image", "video", "text"]
    image_ref, video_ref = generate.images
    assert image_ref.video is None and image_ref.mm_hash in by_hash and not image_ref.chunks
    assert (video_ref.mm_hash, video_ref.video, video_ref.data) == (video.mm_hash, video.video, None)
    assert [c.mm_hash for c in video_ref.chunks] == [c.mm_hash for c in video.chunks]
    address_of = {it["mm_hash"]: e.producer.address for e, items in zip(stack.encoders, sent, strict=True)
                  for it in items}
    assert [c.source for c in video_ref.chunks] == [address_of[c.mm_hash] for c in video_ref.chunks]
    assert image_ref.source == address_of[image_ref.mm_hash]
    assert not any(c.pending or c.cached for c in video_ref.chunks)


def test_sampling_settings_reach_the_plan_the_encoders_and_the_decoder_get(stack: Stack) -> None:
    kwargs = {"mm_processor_kwargs": {"fps": 1.0, "max_pixels": QWEN2.min_pixels}}
    assert stack.chat(body(part(video_url()), **kwargs)).status_code == 200
    [video] = expected_video(part(video_url()), **kwargs)
    [only] = video.chunks  # 4 frames at 1 fps: one chunk, the video's own hash
    [[item]] = [items for items in stack.encoded() if items]
    assert item["mm_hash"] == only.mm_hash == video.mm_hash and item["video"]["sampling"] == {
        "num_frames": 4, "fps": 1.0, "max_pixels": QWEN2.min_pixels}
    ref = stack.decoder.bodies[-1]["images"][0]
    assert ref["video"] == msgspec.to_builtins(video.video) and [c["mm_hash"] for c in ref["chunks"]] == [only.mm_hash]


@pytest.mark.parametrize("request_body,status,code,param", [
    (body(*[part(video_url())] * 5), 400, "too_many_videos", "messages"),
    (body(part(video_url(b"junk"))), 400, "invalid_video", "messages.0.content.0.video_url.url"),
    (body(part(video_url()), mm_processor_kwargs={"num_frames": 300}), 400, "video_too_large",
     "mm_processor_kwargs.num_frames"),
    (body(part(video_url()), mm_processor_kwargs={"fps": 0}), 400, "invalid_request", "mm_processor_kwargs.fps"),
    (body(part(video_url()), mm_processor_kwargs={"do_resize": False}), 400, "invalid_request",
     "mm_processor_kwargs.do_resize"),
    (body({"type": "video_url", "video_url": {}}), 400, "invalid_request", "messages.0.content.0.video_url.url"),
])
def test_a_refused_video_is_an_openai_error_and_nothing_is_encoded_or_generated(
        stack: Stack, request_body: dict[str, Any], status: int, code: str, param: str) -> None:
    resp = stack.chat(request_body)
    assert resp.status_code == status and (resp.json()["error"]["code"], resp.json()["error"]["param"]) == (code, param)
    assert_valid("ErrorResponse", resp.json())
    assert stack.encoded() == [[], []] and stack.decoder.bodies == []


@pytest.mark.parametrize("stack", [IDENTITY, {**IDENTITY, "video": {"sampler": "mystery"}}], indirect=True)
def test_a_fleet_whose_model_takes_no_video_refuses_videos(stack: Stack) -> None:
    resp = stack.chat(body(part(video_url())))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "video_not_supported"
    assert stack.encoded() == [[], []] and stack.decoder.bodies == []
    assert stack.chat(body(IMAGE)).status_code == 200  # images still work


def test_the_openai_client_sends_videos_and_mm_processor_kwargs_with_extra_body(stack: Stack) -> None:
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=stack.client, max_retries=0)
    answer = api.chat.completions.create(
        model="demo", max_tokens=3, extra_body={"mm_processor_kwargs": {"num_frames": 4}},
        messages=[{"role": "user", "content": [part(video_url()), {"type": "text", "text": "What happens?"}]}],
    )  # video_url parts are vLLM's: the openai package sends them as given
    assert answer.choices[0].message.content
    assert stack.decoder.bodies[-1]["images"][0]["video"]["sampling"]["num_frames"] == 4


def test_aggregated_mode_sends_the_video_file_with_its_whole_part() -> None:
    decoder = FakeDecoder(identity=VIDEO_IDENTITY)
    cfg = ProxyConfig(encode_urls=(), decode_urls=(decoder.url,), aggregated=True, startup_timeout=10.0)
    try:
        with TestClient(create_app(cfg)) as client:
            resp = client.post("/v1/chat/completions", json=body(part(video_url()), IMAGE))
    finally:
        decoder.close()
    assert resp.status_code == 200, resp.text
    video_ref, image_ref = decoder.bodies[-1]["images"]
    [video] = expected_video(part(video_url()))
    assert video_ref == {"mm_hash": video.mm_hash, "data": video_url().split(",", 1)[1],
                         "video": msgspec.to_builtins(video.video)}
    assert image_ref["data"] == as_data_url(PNG).split(",", 1)[1] and "video" not in image_ref


# --- Generation: chunk refs and their recovery --------------------------------------------------------------

def video_chat() -> tuple[PreparedChat, VideoItem]:
    chat = prepare_chat(ChatCompletionRequest.model_validate(body(IMAGE, part(video_url()))), config(
        video_chunk_frames=4), video=QWEN2)
    video = chat.items[1]
    assert isinstance(video, VideoItem) and len(video.chunks) == 2
    return chat, video


def test_chunk_refs_say_which_chunks_are_pending_and_which_were_cached() -> None:
    chat, video = video_chat()
    first, second = (c.mm_hash for c in video.chunks)
    fleet = FakeFleet({"d0": [FakeStream([DONE])]})
    gen = Generation(fleet, chat, "rid")  # type: ignore[arg-type]
    sources = {it.mm_hash: f"tcp://{i}" for i, it in enumerate(chat.encodes)}
    asyncio.run(gen.open(sources, pending=frozenset({second}), cached=frozenset({first})))
    ref = fleet.opened[0][1]["images"][1]
    assert ref["chunks"] == [{"mm_hash": first, "source": "tcp://1", "cached": True},
                             {"mm_hash": second, "source": "tcp://2", "pending": True}]
    assert "source" not in ref and "data" not in ref


def test_a_chunk_the_decoder_lost_is_re_encoded_alone_and_the_request_retried() -> None:
    chat, video = video_chat()
    lost = video.chunks[1].mm_hash
    missing = APIError(409, "missing", code="missing_embeddings", extra={"missing": [lost]})
    fleet = FakeFleet({"d0": [missing, FakeStream([DONE])]})
    gen = Generation(fleet, chat, "rid")  # type: ignore[arg-type]
    asyncio.run(gen.open({it.mm_hash: "tcp://e0" for it in chat.encodes}))
    assert fleet.encode_calls == [([lost], False)]
    chunks = fleet.opened[1][1]["images"][1]["chunks"]
    assert [c["source"] for c in chunks] == ["tcp://e0", "tcp://re-encoded"]


def test_a_prepared_chat_without_videos_is_unchanged() -> None:
    chat = PreparedChat(messages=[{"role": "user", "content": "hi"}], items=[], sampling=SamplingParams())
    assert chat.encodes == []
