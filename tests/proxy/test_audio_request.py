"""Audio parts (OpenAI's input_audio, vLLM's audio_url: proxy/audio.py): every bad shape is a 400 naming its field;
a model without audio (every family served today) answers 400 audio_not_supported before anything is fetched or
decoded; the count and byte caps and the image URL guards hold; output audio stays a 400; for a model that reports
audio (faked here) each clip is probed, hashed and planned in chunks for the encoders."""
from __future__ import annotations

import base64
import io
import json
import math
import struct
import threading
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from epd_common.errors import APIError
from epd_contracts.audio import AudioConfig, AudioPart, audio_hash, chunk_hash, part_hash
from epd_contracts.hashing import mm_hash
from proxy.app import create_app
from proxy.audio import AudioItem, fleet_audio_config
from proxy.config import ProxyConfig
from proxy.prepare import PreparedChat, prepare_chat
from proxy.protocol import ChatCompletionRequest
from tests.openai_schema import assert_valid
from tests.proxy.fake_decoder import IDENTITY, FakeDecoder
from tests.proxy.media_helpers import PNG, CountingServer, as_data_url, config, connections_made, serve

RATE = AudioConfig(sample_rate=16_000)
AUDIO_IDENTITY = {**IDENTITY, "audio": RATE.as_dict()}
QUESTION = {"type": "text", "text": "What is said?"}


def make_wav(seconds: float = 1.0, rate: int = 16_000, tone: float = 440.0) -> bytes:
    """A mono 16-bit PCM WAV of a sine tone (the stdlib's wave module)."""
    n = int(seconds * rate)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(struct.pack(f"<{n}h", *(int(8000 * math.sin(2 * math.pi * tone * i / rate)) for i in range(n))))
    return buf.getvalue()


WAV = make_wav()


def input_audio(raw: bytes = WAV, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": fmt}}


def audio_url(url: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": url}}


def body(*parts: dict[str, Any], role: str = "user", **extra: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": role, "content": [*parts, QUESTION]}], "max_tokens": 3, **extra}


def prepared(*parts: dict[str, Any], audio: AudioConfig | None = RATE, cfg: ProxyConfig | None = None) -> PreparedChat:
    return prepare_chat(ChatCompletionRequest.model_validate(body(*parts)), cfg or config(), audio=audio)


def refused(*parts: dict[str, Any], audio: AudioConfig | None = RATE, cfg: ProxyConfig | None = None) -> APIError:
    with pytest.raises(APIError) as err:
        prepared(*parts, audio=audio, cfg=cfg)
    assert err.value.status == 400
    assert_valid("ErrorResponse", err.value.body())
    return err.value


def assert_error(resp: Any, param: str | None, code: str, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert_valid("ErrorResponse", resp.json())
    error: dict[str, Any] = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    return error


@pytest.fixture
def fake_decoder(request: pytest.FixtureRequest) -> Iterator[FakeDecoder]:
    decoder = FakeDecoder(identity=getattr(request, "param", IDENTITY))
    yield decoder
    decoder.close()


@pytest.fixture
def proxy(fake_decoder: FakeDecoder) -> Iterator[TestClient]:
    """The proxy app (aggregated) in front of `fake_decoder`; loopback media hosts allowed, so a fetch would connect."""
    cfg = ProxyConfig(encode_urls=(), decode_urls=(fake_decoder.url,), aggregated=True, startup_timeout=10.0,
                      allowed_media_domains=("127.0.0.1",))
    with TestClient(create_app(cfg)) as client:
        yield client


# --- shapes ------------------------------------------------------------------------------------------------

B64 = base64.b64encode(WAV).decode()
SHAPES = [
    ({"type": "input_audio"}, "messages.0.content.0.input_audio", "invalid_request"),
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, "messages.0.content.0.input_audio.data",
     "invalid_request"),
    ({"type": "input_audio", "input_audio": {"data": B64}}, "messages.0.content.0.input_audio.format",
     "invalid_request"),
    ({"type": "input_audio", "input_audio": {"data": B64, "format": "flac"}},
     "messages.0.content.0.input_audio.format", "invalid_request"),
    ({"type": "input_audio", "input_audio": {"data": 5, "format": "wav"}}, "messages.0.content.0.input_audio.data",
     "invalid_request"),
    ({"type": "input_audio", "input_audio": "AAAA"}, "messages.0.content.0.input_audio", "invalid_request"),
    ({"type": "input_audio", "input_audio": {"data": B64, "format": "wav", "uuid": "x"}},
     "messages.0.content.0.input_audio.uuid", "unsupported_parameter"),
    ({**input_audio(), "uuid": "x"}, "messages.0.content.0.uuid", "unsupported_parameter"),
    ({"type": "audio_url"}, "messages.0.content.0.audio_url", "invalid_request"),
    ({"type": "audio_url", "audio_url": {}}, "messages.0.content.0.audio_url.url", "invalid_request"),
    ({"type": "audio_url", "audio_url": "http://example.com/a.wav"}, "messages.0.content.0.audio_url",
     "invalid_request"),
    ({"type": "audio_url", "audio_url": {"url": "http://example.com/a.wav", "detail": "low"}},
     "messages.0.content.0.audio_url.detail", "unsupported_parameter"),
    ({**audio_url("http://example.com/a.wav"), "mm_hash": "ab"}, "messages.0.content.0.mm_hash",
     "unsupported_parameter"),
]


@pytest.mark.parametrize("part,param,code", SHAPES)
def test_every_bad_shape_of_an_audio_part_is_a_400_naming_its_field(proxy: TestClient, fake_decoder: FakeDecoder,
                                                                    part: dict[str, Any], param: str,
                                                                    code: str) -> None:
    assert_error(proxy.post("/v1/chat/completions", json=body(part)), param, code)
    assert not fake_decoder.bodies


@pytest.mark.parametrize("role", ["system", "assistant", "developer"])
@pytest.mark.parametrize("part", [input_audio(), audio_url("http://example.com/a.wav")])
def test_audio_outside_a_user_message_is_refused_as_images_are(proxy: TestClient, fake_decoder: FakeDecoder,
                                                               role: str, part: dict[str, Any]) -> None:
    error = assert_error(proxy.post("/v1/chat/completions", json=body(part, role=role)),
                         "messages.0.content.0", "invalid_value")
    assert "user messages" in error["message"]
    image = {"type": "image_url", "image_url": {"url": as_data_url(PNG)}}
    assert_error(proxy.post("/v1/chat/completions", json=body(image, role=role)), "messages.0.content.0",
                 "invalid_value")  # the same answer as an image gets
    assert not fake_decoder.bodies


@pytest.mark.parametrize("data", ["not base64!", "QUJD=", "QUJDRA=", "é" * 8])
def test_input_audio_that_is_not_base64_is_a_400_invalid_audio(data: str) -> None:
    part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    err = refused(part)
    assert (err.param, err.code) == ("messages.0.content.0.input_audio.data", "invalid_audio")


# --- a model without audio -----------------------------------------------------------------------------------

def test_a_model_without_audio_refuses_every_audio_part_before_anything_is_fetched(
        proxy: TestClient, fake_decoder: FakeDecoder, server: CountingServer) -> None:
    server.routes["/a.wav"] = serve(WAV, "audio/wav")
    server.routes["/i.png"] = serve(PNG)
    image = {"type": "image_url", "image_url": {"url": server.url("/i.png")}}
    bad = {"type": "input_audio", "input_audio": {"data": "not base64!", "format": "mp3"}}  # never decoded
    for parts, param in [((audio_url(server.url("/a.wav")),), "messages.0.content.0"),
                         ((image, audio_url(server.url("/a.wav"))), "messages.0.content.1"),
                         ((image, bad, input_audio()), "messages.0.content.1"),
                         ((input_audio(),), "messages.0.content.0")]:
        error = assert_error(proxy.post("/v1/chat/completions", json=body(*parts)), param, "audio_not_supported")
        assert "does not take audio" in error["message"]
    assert connections_made(server) == 0 and server.paths() == ["/__sync__"]
    assert not fake_decoder.bodies
    resp = proxy.post("/v1/chat/completions", json=body(image))  # the same image alone is fetched and answered
    assert resp.status_code == 200, resp.text


def test_the_fleet_takes_audio_only_when_its_identity_reports_an_audio_config() -> None:
    assert fleet_audio_config(None) is None and fleet_audio_config(IDENTITY) is None
    assert fleet_audio_config({**IDENTITY, "audio": None}) is None
    assert fleet_audio_config({**IDENTITY, "audio": {"sample_rate": "fast"}}) is None  # not a config: no audio
    assert fleet_audio_config({**IDENTITY, "audio": {"sample_rate": 16_000, "x": 1}}) is None
    assert fleet_audio_config(AUDIO_IDENTITY) == RATE


def test_prepare_refuses_audio_for_a_model_without_it_without_loading_anything(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def load(*args: object) -> bytes:
        raise AssertionError("something was loaded")
    monkeypatch.setattr("proxy.image.load_media_bytes", load)
    monkeypatch.setattr("proxy.audio.load_media_bytes", load)
    monkeypatch.setattr("proxy.audio.decode_base64", load)
    image = {"type": "image_url", "image_url": {"url": as_data_url(PNG)}}
    err = refused(image, audio_url("http://example.com/a.wav"), input_audio(), audio=None)
    assert (err.param, err.code) == ("messages.0.content.1", "audio_not_supported")


# --- counts and bytes ------------------------------------------------------------------------------------------

def test_more_audio_parts_than_max_audios_per_request_is_a_400_before_anything_is_loaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("proxy.audio.decode_base64", lambda *a: pytest.fail("decoded"))
    parts = [input_audio(), audio_url("http://example.com/a.wav")] * 2 + [input_audio()]
    for audio in (RATE, None):  # counted first, whatever the model takes
        err = refused(*parts, audio=audio)
        assert (err.param, err.code) == ("messages", "too_many_audios") and "5 audio parts" in err.message
    err = refused(input_audio(), cfg=config(max_audios_per_request=0))
    assert (err.param, err.code) == ("messages", "too_many_audios")


def test_input_audio_past_max_audio_bytes_is_refused_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("proxy.audio.base64.b64decode", lambda *a, **k: pytest.fail("decoded"))
    err = refused(input_audio(WAV), cfg=config(max_audio_bytes=len(WAV) - 100))
    assert (err.param, err.code) == ("messages.0.content.0.input_audio.data", "audio_too_large")


def test_an_audio_url_past_max_audio_bytes_is_refused_while_it_is_read(server: CountingServer) -> None:
    cfg = config(max_audio_bytes=len(WAV) - 100, allowed_media_domains=("127.0.0.1",))
    server.routes["/declared.wav"] = serve(WAV, "audio/wav")
    server.routes["/chunked.wav"] = serve(WAV, "audio/wav", with_length=False)  # no length: capped while reading
    for path in ("/declared.wav", "/chunked.wav"):
        err = refused(audio_url(server.url(path)), cfg=cfg)
        assert (err.param, err.code) == ("messages.0.content.0.audio_url.url", "audio_too_large")
    err = refused(audio_url(as_data_url(WAV, "audio/wav")), cfg=cfg)
    assert (err.param, err.code) == ("messages.0.content.0.audio_url.url", "audio_too_large")


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.1", "169.254.169.254", "[::1]", "metadata.google.internal"])
def test_an_audio_url_to_a_private_host_is_refused_before_connecting(server: CountingServer, host: str) -> None:
    server.routes["/a.wav"] = serve(WAV, "audio/wav")
    url = server.url("/a.wav") if host == "127.0.0.1" else f"http://{host}/a.wav"
    err = refused(audio_url(url))
    assert (err.param, err.code) == ("messages.0.content.0.audio_url.url", "audio_url_forbidden")
    assert connections_made(server) == 0


@pytest.mark.parametrize("url,code", [
    ("ftp://example.com/a.wav", "invalid_audio_url"),
    ("file:///etc/passwd", "audio_url_forbidden"),  # no --allowed-local-media-path
    (as_data_url(PNG, "image/png"), "invalid_audio_url"),  # a data: URL of another kind
    ("data:audio/wav,plain", "invalid_audio_url"),
])
def test_an_audio_url_takes_the_image_url_forms_and_guards(url: str, code: str) -> None:
    err = refused(audio_url(url))
    assert (err.param, err.code) == ("messages.0.content.0.audio_url.url", code)


def test_an_audio_url_whose_server_answers_another_content_type_is_refused_unread(server: CountingServer) -> None:
    server.routes["/page"] = serve(b"<html></html>", "text/html")
    err = refused(audio_url(server.url("/page")), cfg=config(allowed_media_domains=("127.0.0.1",)))
    assert (err.param, err.code) == ("messages.0.content.0.audio_url.url", "invalid_audio")


# --- output audio ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,param", [({"modalities": ["text", "audio"]}, "modalities"),
                                          ({"modalities": ["audio"]}, "modalities"),
                                          ({"audio": {"voice": "alloy", "format": "wav"}}, "audio")])
def test_output_audio_stays_a_400(proxy: TestClient, fake_decoder: FakeDecoder, fields: dict[str, Any],
                                  param: str) -> None:
    request = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], **fields}
    assert_error(proxy.post("/v1/chat/completions", json=request), param, "unsupported_parameter")
    assert not fake_decoder.bodies
    ok = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "modalities": ["text"]}
    assert proxy.post("/v1/chat/completions", json=ok).status_code == 200


# --- concurrent streams -----------------------------------------------------------------------------------------

def test_streams_finish_unchanged_while_audio_requests_are_refused(proxy: TestClient) -> None:
    def stream(i: int) -> str:
        request = {"model": "demo", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 5,
                   "stream": True}
        resp = proxy.post("/v1/chat/completions", json=request)
        assert resp.status_code == 200, resp.text
        assert resp.text.rstrip().endswith("data: [DONE]")
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        assert not any("error" in c for c in chunks)
        return "".join(f"{ch['delta'].get('content') or ''}|{ch['finish_reason']}" for c in chunks
                       for ch in c["choices"])

    alone = [stream(i) for i in range(4)]
    go = threading.Barrier(8)

    def refused_audio(i: int) -> int:
        go.wait(30)
        parts = (input_audio(),) if i % 2 else (audio_url("http://127.0.0.1:9/a.wav"), input_audio())
        return int(proxy.post("/v1/chat/completions", json=body(*parts)).json()["error"]["code"] ==
                   "audio_not_supported")

    def together(i: int) -> str:
        go.wait(30)
        return stream(i)

    with ThreadPoolExecutor(max_workers=8) as pool:
        streams = [pool.submit(together, i) for i in range(4)]
        refusals = [pool.submit(refused_audio, i) for i in range(4)]
        assert sum(f.result(timeout=60) for f in refusals) == 4
        assert [f.result(timeout=60) for f in streams] == alone


# --- a model that takes audio (faked here; tests/e2e/test_audio_e2e.py runs real ones) --------------------------------

def test_a_clip_is_probed_hashed_over_its_bytes_and_resampling_settings_and_marked_in_the_prompt() -> None:
    chat = prepared(input_audio(), audio_url(as_data_url(WAV, "audio/wav")), input_audio(make_wav(0.5)))
    assert chat.messages[0]["content"] == [{"type": "audio"}] * 3 + [QUESTION]
    first, second, third = chat.items
    assert isinstance(first, AudioItem) and isinstance(second, AudioItem) and isinstance(third, AudioItem)
    assert first.mm_hash == second.mm_hash == audio_hash(WAV, RATE)  # the same bytes, however they came
    assert third.mm_hash == audio_hash(make_wav(0.5), RATE) != first.mm_hash
    assert first.data == WAV and first.param == "messages.0.content.0.input_audio.data"
    assert (first.info.sample_rate, first.info.channels) == (16_000, 1)
    assert first.info.duration_s == pytest.approx(1.0, abs=0.05)
    # each clip is one chunk (the fleet's config has no window): what the encoders get, in prompt order
    assert [c.mm_hash for c in chat.encodes] == [first.mm_hash, first.mm_hash, third.mm_hash]
    assert chat.encodes[0].audio == AudioPart(sample_rate=16_000) == first.audio
    assert chat.params[first.mm_hash] == "messages.0.content.0.input_audio.data"
    assert audio_hash(WAV, AudioConfig(sample_rate=24_000)) != first.mm_hash != mm_hash(WAV)  # its own tag


def test_a_repeated_clip_is_loaded_once_and_clips_tell_prefix_keys_apart(server: CountingServer) -> None:
    server.routes["/a.wav"] = serve(WAV, "audio/wav")
    cfg = config(allowed_media_domains=("127.0.0.1",))
    chat = prepared(audio_url(server.url("/a.wav")), audio_url(server.url("/a.wav")), cfg=cfg)
    assert [a.mm_hash for a in chat.items] == [audio_hash(WAV, RATE)] * 2
    assert server.paths().count("/a.wav") == 1
    other = prepared(input_audio(make_wav(tone=880.0)))
    same = prepared(input_audio(WAV))
    assert prepared(input_audio(WAV)).prefix_keys == same.prefix_keys != other.prefix_keys


@pytest.mark.parametrize("raw,fmt", [(b"RIFF\0\0\0\0WAVEnot audio at all", "wav"), (b"\0" * 4096, "mp3"),
                                     (WAV[:40], "wav"), (b"", "wav"), (WAV, "mp3"), (PNG, "wav")])
def test_bytes_that_are_not_audio_we_accept_are_a_400_invalid_audio(raw: bytes, fmt: str) -> None:
    err = refused(input_audio(raw, fmt))
    assert (err.param, err.code) == ("messages.0.content.0.input_audio.data", "invalid_audio")


def test_a_clip_longer_than_max_audio_seconds_is_a_400_audio_too_large() -> None:
    err = refused(audio_url(as_data_url(WAV, "audio/wav")), cfg=config(max_audio_seconds=0.5))
    assert (err.param, err.code) == ("messages.0.content.0.audio_url.url", "audio_too_large")


def test_a_long_clip_is_planned_in_chunks_of_whole_windows_for_a_family_that_encodes_windows_apart() -> None:
    """A 7 s clip, 2 s windows, chunks of 4 s: [0, 2) and [2, end) windows, each with its own hash and the whole
    file; the last runs to the end. Cut at the family's max_seconds first (5 s here: 2 chunks of 4 s from 4.75)."""
    wav = make_wav(7.0)
    windowed = AudioConfig(sample_rate=16_000, window_seconds=2.0)
    chat = prepared(input_audio(wav), audio=windowed, cfg=config(audio_chunk_seconds=4.0))
    [clip] = chat.items
    assert isinstance(clip, AudioItem) and clip.mm_hash == audio_hash(wav, windowed)
    assert [(c.audio.first, c.audio.count) for c in chat.encodes if c.audio] == [(0, 2), (2, 0)]
    assert [c.mm_hash for c in chat.encodes] == [chunk_hash(clip.mm_hash, 0, 2), chunk_hash(clip.mm_hash, 2, 0)]
    assert all(c.data == wav and part_hash(wav, c.audio) == c.mm_hash for c in chat.encodes if c.audio)
    cut = AudioConfig(sample_rate=16_000, window_seconds=2.0, max_seconds=5.0)
    assert len(prepared(input_audio(wav), audio=cut, cfg=config(audio_chunk_seconds=2.0)).encodes) == 3
    one = prepared(input_audio(wav), audio=windowed, cfg=config(audio_chunk_seconds=30.0))
    assert [c.mm_hash for c in one.encodes] == [one.items[0].mm_hash]  # within one chunk: the clip's own hash


def test_the_audio_flags_reach_the_proxy_config_with_their_defaults() -> None:
    from epd_launcher.cli import _config
    from epd_launcher.flags import parse_args

    attach = ["--encode-servers-urls", "http://e:1", "--decode-servers-urls", "http://d:2"]
    _, args = parse_args(attach)
    cfg = _config(args, ("http://e",), ("http://d",), None, None)
    assert (cfg.max_audios_per_request, cfg.max_audio_bytes, cfg.max_audio_seconds) == (4, 25 << 20, 600.0)
    assert (cfg.audio_chunk_seconds, cfg.max_audio_fanout_bytes) == (30.0, 64 << 20)
    _, args = parse_args([*attach, "--max-audios-per-request", "0", "--max-audio-bytes", "1000",
                          "--max-audio-seconds", "2.5", "--audio-chunk-seconds", "4", "--max-audio-fanout-bytes", "9"])
    cfg = _config(args, ("http://e",), ("http://d",), None, None)
    assert (cfg.max_audios_per_request, cfg.max_audio_bytes, cfg.max_audio_seconds) == (0, 1000, 2.5)
    assert (cfg.audio_chunk_seconds, cfg.max_audio_fanout_bytes) == (4.0, 9)


def test_a_large_file_is_cut_into_fewer_chunks_so_its_fan_out_stays_bounded() -> None:
    """Each chunk's /encode carries the whole file and each encoder decodes all of it: a 7 s clip in chunks of one
    2 s window would be sent 4 times; with room for 2 copies it goes in 2 chunks of 2 windows."""
    wav = make_wav(7.0)
    windowed = AudioConfig(sample_rate=16_000, window_seconds=2.0)
    free = prepared(input_audio(wav), audio=windowed, cfg=config(audio_chunk_seconds=2.0))
    assert len(free.encodes) == 4
    bounded = prepared(input_audio(wav), audio=windowed,
                       cfg=config(audio_chunk_seconds=2.0, max_audio_fanout_bytes=2 * len(wav) + 1))
    assert [(c.audio.first, c.audio.count) for c in bounded.encodes if c.audio] == [(0, 2), (2, 0)]
    assert sum(len(c.data) for c in bounded.encodes) <= 2 * len(wav) + 1
