"""A video's sound track (mm_processor_kwargs.use_audio_in_video, proxy/audio.py `load_tracks`): for a model whose
AudioConfig has in_video, each video is followed by its track, an audio item over the video's bytes planned in
chunks like a clip and named by the video's field; the prompt keeps one marker per video. A model without it, a
silent video, a track past the audio limits and a non-bool flag are each a 400, before anything is loaded where
that can be known first."""
from __future__ import annotations

from typing import Any

import pytest

from epd_common.errors import APIError
from epd_common.video_sampling import VideoConfig
from epd_contracts.audio import AudioConfig, audio_hash
from proxy.audio import AudioItem
from proxy.prepare import PreparedChat, prepare_chat
from proxy.protocol import ChatCompletionRequest
from proxy.video import VideoItem
from tests.audio_clips import make_video_with_audio
from tests.factories import make_video
from tests.openai_schema import assert_valid
from tests.proxy.media_helpers import as_data_url, config

QWEN2 = VideoConfig(sampler="qwen2", temporal_patch=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
OMNI = AudioConfig(sample_rate=16_000, window_seconds=2.0, max_seconds=300.0, in_video=True)
NOT_IN_VIDEO = AudioConfig(sample_rate=16_000, window_seconds=2.0, max_seconds=300.0)
WITH_TRACK = make_video_with_audio(12, 2.0, 6.0)
PARAM = "messages.0.content.0.video_url.url"
KWARGS = {"mm_processor_kwargs": {"use_audio_in_video": True}}


def video(raw: bytes = WITH_TRACK) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": as_data_url(raw, "video/mp4")}}


def prepared(*parts: dict[str, Any], audio: AudioConfig | None = OMNI, cfg: Any = None, **extra: Any) -> PreparedChat:
    msg = {"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": [msg], **extra})
    return prepare_chat(req, cfg or config(audio_chunk_seconds=2.0), video=QWEN2, audio=audio)


def refused(*parts: dict[str, Any], audio: AudioConfig | None = OMNI, cfg: Any = None, **extra: Any) -> APIError:
    with pytest.raises(APIError) as err:
        prepared(*parts, audio=audio, cfg=cfg, **extra)
    assert err.value.status == 400
    assert_valid("ErrorResponse", err.value.body())
    return err.value


def test_each_video_is_followed_by_its_track_planned_in_chunks() -> None:
    chat = prepared(video(), video(), **KWARGS)
    assert chat.messages[0]["content"][:2] == [{"type": "video"}] * 2  # one marker per video, none for a track
    first, track, again, track_again = chat.items
    assert isinstance(first, VideoItem) and isinstance(track, AudioItem) and track is track_again
    assert track.in_video and track.data == WITH_TRACK and track.mm_hash == audio_hash(WITH_TRACK, OMNI)
    assert track.info.container == "mp4" and track.info.codec == "aac"
    assert [c.audio.first for c in track.chunks if c.audio] == [0, 1, 2]  # 6 s in 2 s windows
    assert chat.params[track.chunks[1].mm_hash] == PARAM
    with_track, alone = prepared(video(), **KWARGS), prepared(video())
    assert alone.items == [first] and with_track.items == [first, track]
    assert alone.prefix_keys != with_track.prefix_keys  # the same messages, another prompt: other routing keys


def test_without_the_flag_or_without_a_video_nothing_is_added() -> None:
    assert [type(it) for it in prepared(video()).items] == [VideoItem]
    assert prepared({"type": "text", "text": "hi"}, **KWARGS).items == []
    off = prepared(video(), mm_processor_kwargs={"use_audio_in_video": False})
    assert [type(it) for it in off.items] == [VideoItem]


@pytest.mark.parametrize("audio", [None, NOT_IN_VIDEO], ids=["no-audio", "audio-but-not-in-video"])
def test_a_model_that_does_not_interleave_a_track_refuses_it_before_loading(
        audio: AudioConfig | None, monkeypatch: pytest.MonkeyPatch) -> None:
    def load(*args: object) -> bytes:
        raise AssertionError("a URL was loaded")
    monkeypatch.setattr("proxy.video.load_media_bytes", load)
    err = refused(video(), audio=audio, **KWARGS)
    assert (err.code, err.param) == ("audio_not_supported", "mm_processor_kwargs.use_audio_in_video")


def test_a_silent_video_is_a_400_naming_it() -> None:
    err = refused(video(make_video(12, fps=2)), **KWARGS)
    assert (err.code, err.param) == ("video_has_no_audio", PARAM)


def test_a_track_past_the_audio_limits_is_refused_as_a_clip_would_be() -> None:
    err = refused(video(), cfg=config(max_audio_seconds=3.0), **KWARGS)
    assert (err.code, err.param) == ("audio_too_large", PARAM)
    err = refused(video(), cfg=config(max_audio_bytes=len(WITH_TRACK) - 1), **KWARGS)
    assert (err.code, err.param) == ("audio_too_large", PARAM)


@pytest.mark.parametrize("value", ["true", 1, None, [True]])
def test_the_flag_is_a_strict_bool(value: Any) -> None:
    with pytest.raises(ValueError, match="use_audio_in_video"):
        ChatCompletionRequest.model_validate({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                              "mm_processor_kwargs": {"use_audio_in_video": value}})
