"""Video parts in prepare_chat (proxy/video.py): each limit and each bad input is a 400 with its code, found before
anything is scheduled (counts and settings before anything is loaded); a good video is planned in chunks as
epd_contracts/video.py says, with the request's mm_processor_kwargs within the server's limits."""
from __future__ import annotations

import base64
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from epd_common.errors import APIError
from epd_common.video import probe_video
from epd_common.video_sampling import VideoConfig, sampled_fps
from epd_contracts.hashing import mm_hash
from epd_contracts.video import VideoPart, VideoSampling, part_hash, plan_chunks, video_hash
from proxy.kinds import remote_kinds
from proxy.prepare import PreparedChat, prepare_chat
from proxy.protocol import ChatCompletionRequest
from proxy.video import VideoItem, fleet_video_config
from scheduler.scheduler import MMItem
from tests.factories import make_image, make_video
from tests.proxy.media_helpers import PNG, CountingServer, Route, as_data_url, config, encode, serve

# Qwen2-VL's video processor settings: pairs of frames, 2 fps
QWEN2 = VideoConfig(sampler="qwen2", temporal_patch=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
CLIP = make_video(40, fps=10)  # 4 s: 8 frames at 2 fps
OTHER_CLIP = make_video(20, fps=10)
PARAM = "messages.0.content.0.video_url.url"


def video_url(raw: bytes = CLIP, mime: str = "video/mp4") -> str:
    return as_data_url(raw, mime)


def part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def request(*parts: dict[str, Any], **extra: Any) -> ChatCompletionRequest:
    msg = {"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}
    return ChatCompletionRequest.model_validate({"model": "demo", "messages": [msg], **extra})


def prepared(*parts: dict[str, Any], video: VideoConfig | None = QWEN2, cfg: Any = None, **extra: Any) -> PreparedChat:
    return prepare_chat(request(*parts, **extra), cfg or config(video_chunk_frames=4), video=video)


def refused(*parts: dict[str, Any], video: VideoConfig | None = QWEN2, cfg: Any = None, **extra: Any) -> APIError:
    with pytest.raises(APIError) as err:
        prepared(*parts, video=video, cfg=cfg, **extra)
    assert err.value.status == 400
    return err.value


def only_video(chat: PreparedChat) -> VideoItem:
    [item] = chat.items
    assert isinstance(item, VideoItem)
    return item


@pytest.fixture
def nothing_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading any image or video fails the test."""
    def load(*args: object) -> bytes:
        raise AssertionError("a URL was loaded")
    monkeypatch.setattr("proxy.video.load_media_bytes", load)
    monkeypatch.setattr("proxy.image.load_media_bytes", load)


# --- a good video ------------------------------------------------------------------------------------------

def test_a_video_becomes_a_marker_and_an_item_planned_in_chunks_of_whole_temporal_patches() -> None:
    chat = prepared(part(video_url()))
    assert chat.messages[0]["content"] == [{"type": "video"}, {"type": "text", "text": "What happens?"}]
    item = only_video(chat)
    info = probe_video(CLIP)
    sampling = VideoSampling(num_frames=8, fps=sampled_fps(info, 8), max_pixels=QWEN2.max_pixels)
    assert sampling.fps == 2.0  # 8 of 40 frames at 10 fps
    assert item.data == CLIP and item.mm_hash == video_hash(CLIP, sampling)
    assert item.video == VideoPart(sampling=sampling, first=0, count=8, total=8)
    planned = plan_chunks(item.mm_hash, 8, 2, 4)
    assert [(c.first, c.count) for c in planned] == [(0, 4), (4, 4)]
    assert item.chunks == tuple(MMItem(mm_hash=c.mm_hash, data=CLIP, video=VideoPart(
        sampling=sampling, first=c.first, count=c.count, total=8)) for c in planned)
    assert [part_hash(CLIP, c.video) for c in item.chunks if c.video] == [c.mm_hash for c in item.chunks]
    assert chat.encodes == list(item.chunks)  # what the scheduler gets: the chunks


@pytest.mark.parametrize("chunk_frames,expected", [(16, [(0, 8)]), (3, [(0, 2), (2, 2), (4, 2), (6, 2)]),
                                                   (6, [(0, 6), (6, 2)])])
def test_chunks_hold_whole_temporal_patches_of_at_most_video_chunk_frames(
        chunk_frames: int, expected: list[tuple[int, int]]) -> None:
    item = only_video(prepared(part(video_url()), cfg=config(video_chunk_frames=chunk_frames)))
    assert [(c.video.first, c.video.count) for c in item.chunks if c.video] == expected
    if len(expected) == 1:  # one chunk: the video's own hash
        assert item.chunks[0].mm_hash == item.mm_hash


def test_a_large_file_is_cut_into_fewer_chunks_than_its_fanout_budget_allows() -> None:
    """Each chunk's /encode carries the whole file: chunks x file bytes stay within --max-video-fanout-bytes."""
    size = len(CLIP)
    for budget, most in ((size * 4, 4), (size * 3, 3), (size * 2 + 1, 2), (size, 1), (1, 1)):
        item = only_video(prepared(part(video_url()), cfg=config(video_chunk_frames=2, max_video_fanout_bytes=budget)))
        assert 1 <= len(item.chunks) <= most and len(item.chunks) * size <= max(budget, size)
        assert sum(c.video.count for c in item.chunks if c.video) == 8
        assert all(c.video.count % 2 == 0 for c in item.chunks if c.video)  # still whole temporal patches
    assert len(only_video(prepared(part(video_url()), cfg=config(video_chunk_frames=2))).chunks) == 4  # no cap hit


def test_a_video_repeated_in_a_request_is_loaded_and_planned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import proxy.video

    loads: list[str] = []
    real = proxy.video.load_media_bytes

    def counting(url: str, *args: Any) -> bytes:
        loads.append(url)
        return real(url, *args)
    monkeypatch.setattr(proxy.video, "load_media_bytes", counting)
    chat = prepared(part(video_url()), part(video_url()))
    assert len(loads) == 1 and chat.items[0] is chat.items[1]


def test_images_and_videos_keep_their_prompt_order() -> None:
    red, blue = as_data_url(PNG), as_data_url(encode(make_image(40, 24)))
    msg = {"role": "user", "content": [image_part(red), {"type": "text", "text": "then"}, part(video_url()),
                                       image_part(blue), part(video_url(OTHER_CLIP))]}
    chat = prepare_chat(ChatCompletionRequest.model_validate({"model": "demo", "messages": [msg]}), config(),
                        video=QWEN2)
    assert [p["type"] for p in chat.messages[0]["content"]] == ["image", "text", "video", "image", "video"]
    kinds = [(type(it).__name__, it.data) for it in chat.items]
    assert kinds == [("ImageItem", PNG), ("VideoItem", CLIP), ("ImageItem", encode(make_image(40, 24))),
                     ("VideoItem", OTHER_CLIP)]
    assert chat.items[0].mm_hash == mm_hash(PNG)  # an image's hash is unchanged by the videos around it
    videos = [it for it in chat.items if isinstance(it, VideoItem)]
    assert [e.mm_hash for e in chat.encodes] == [chat.items[0].mm_hash, *[c.mm_hash for c in videos[0].chunks],
                                                 chat.items[2].mm_hash, *[c.mm_hash for c in videos[1].chunks]]


def test_file_urls_of_videos_are_read_under_the_allowed_directory(tmp_path: Path) -> None:
    (tmp_path / "clip.mp4").write_bytes(CLIP)
    chat = prepared(part(f"file://{tmp_path}/clip.mp4"),
                    cfg=config(allowed_local_media_path=str(tmp_path), video_chunk_frames=4))
    assert only_video(chat).data == CLIP


# --- mm_processor_kwargs -----------------------------------------------------------------------------------

def test_fps_num_frames_and_max_pixels_override_the_models_defaults() -> None:
    default = only_video(prepared(part(video_url())))
    slow = only_video(prepared(part(video_url()), mm_processor_kwargs={"fps": 1.0}))
    assert (slow.video.total, slow.video.sampling.fps, len(slow.chunks)) == (4, 1.0, 1)
    counted = only_video(prepared(part(video_url()), mm_processor_kwargs={"num_frames": 12}))
    assert (counted.video.sampling.num_frames, counted.video.total, len(counted.chunks)) == (12, 12, 3)
    small = only_video(prepared(part(video_url()), mm_processor_kwargs={"max_pixels": QWEN2.min_pixels}))
    assert small.video.sampling.max_pixels == QWEN2.min_pixels and small.video.total == default.video.total
    hashes = {default.mm_hash, slow.mm_hash, counted.mm_hash, small.mm_hash}
    assert len(hashes) == 4  # other sampling, other embeddings: never shared
    assert only_video(prepared(part(video_url()), mm_processor_kwargs={})).mm_hash == default.mm_hash


def test_a_rate_that_would_pass_the_frame_limit_is_clamped_to_it() -> None:
    item = only_video(prepared(part(video_url()), cfg=config(max_video_frames=6), mm_processor_kwargs={"fps": 100}))
    assert (item.video.sampling.num_frames, item.video.total) == (6, 6)


@pytest.mark.usefixtures("nothing_loaded")
@pytest.mark.parametrize("kwargs,param,code", [
    ({"num_frames": 7}, "mm_processor_kwargs.num_frames", "video_too_large"),
    ({"fps": 1.0, "num_frames": 4}, "mm_processor_kwargs", "invalid_value"),
    ({"max_pixels": QWEN2.max_pixels + 1}, "mm_processor_kwargs.max_pixels", "invalid_value"),
    ({"max_pixels": QWEN2.min_pixels - 1}, "mm_processor_kwargs.max_pixels", "invalid_value"),
])
def test_settings_outside_the_limits_are_refused_before_any_video_is_loaded(
        kwargs: dict[str, Any], param: str, code: str) -> None:
    err = refused(part(video_url()), cfg=config(max_video_frames=6), mm_processor_kwargs=kwargs)
    assert (err.param, err.code) == (param, code)


@pytest.mark.parametrize("kwargs", [{"fps": 0}, {"fps": -1}, {"num_frames": 0}, {"max_pixels": 0},
                                    {"size": {"longest_edge": 10}}, {"fps": "fast"}])
def test_other_keys_and_values_of_mm_processor_kwargs_do_not_validate(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        request(part(video_url()), mm_processor_kwargs=kwargs)


def test_a_num_frames_the_video_cannot_give_is_a_400_naming_it() -> None:
    err = refused(part(video_url(OTHER_CLIP)), mm_processor_kwargs={"num_frames": 30})  # 20 frames in the file
    assert (err.param, err.code) == ("mm_processor_kwargs.num_frames", "invalid_video")
    uniform = VideoConfig(sampler="uniform", temporal_patch=1, min_pixels=1, max_pixels=1 << 20, fps=None,
                          num_frames=8)  # LLaVA-OneVision's rule: a rate above the video's is refused, as there
    assert only_video(prepared(part(video_url(OTHER_CLIP)), video=uniform)).video.total == 8
    err = refused(part(video_url(OTHER_CLIP)), video=uniform, mm_processor_kwargs={"fps": 20.0})
    assert (err.param, err.code) == ("mm_processor_kwargs.fps", "invalid_video")


# --- refused before anything is loaded ---------------------------------------------------------------------

@pytest.mark.usefixtures("nothing_loaded")
def test_more_videos_than_the_maximum_are_refused_before_any_is_loaded() -> None:
    err = refused(*[part("http://example.com/v.mp4")] * 5)
    assert (err.code, err.param) == ("too_many_videos", "messages") and "5 videos" in err.message
    err = refused(part("http://example.com/v.mp4"), cfg=config(max_videos_per_request=0))
    assert err.code == "too_many_videos"


@pytest.mark.usefixtures("nothing_loaded")
def test_a_model_without_video_refuses_videos_before_any_is_loaded() -> None:
    err = refused(image_part("http://example.com/x.png"), part("http://example.com/v.mp4"), video=None)
    assert (err.code, err.param) == ("video_not_supported", "messages.0.content.1")


@pytest.mark.usefixtures("nothing_loaded")
def test_videos_outside_user_messages_are_refused() -> None:
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [part("http://example.com/v.mp4")]}]})
    with pytest.raises(APIError) as err:
        prepare_chat(req, config(), video=QWEN2)
    assert err.value.param == "messages.1.content.0" and "videos are only allowed in user messages" in err.value.message


def test_the_fleets_video_config_comes_from_its_identity_and_garbage_means_none() -> None:
    assert fleet_video_config({"family": "qwen2_vl", "video": QWEN2.as_dict()}) == QWEN2
    for identity in (None, {"family": "llava"}, {"video": None}, {"video": "yes"}, {"video": {"sampler": "x"}},
                     {"video": {**QWEN2.as_dict(), "temporal_patch": 0}}, {"video": {"unknown": 1}}):
        assert fleet_video_config(identity) is None


# --- limits and bad bytes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,code,words", [
    ({"max_video_bytes": len(CLIP) - 1}, "video_too_large", "larger than"),
    ({"max_video_duration": 3.5}, "video_too_large", "lasts 4.0 s"),
    ({"max_video_frame_pixels": 96 * 48 - 1}, "video_too_large", "96x48"),
])
def test_each_limit_is_a_400_video_too_large(overrides: dict[str, Any], code: str, words: str) -> None:
    err = refused(part(video_url()), cfg=config(**overrides))
    assert (err.code, err.param) == (code, PARAM) and words in err.message


def test_a_video_file_over_the_byte_limit_is_refused_while_read(tmp_path: Path) -> None:
    (tmp_path / "clip.mp4").write_bytes(CLIP)
    err = refused(part(f"file://{tmp_path}/clip.mp4"),
                  cfg=config(allowed_local_media_path=str(tmp_path), max_video_bytes=len(CLIP) - 1))
    assert err.code == "video_too_large"


@pytest.mark.parametrize("url,code", [
    (video_url(b"not a video at all"), "invalid_video"),
    (video_url(CLIP[: len(CLIP) // 2]), "invalid_video"),
    (video_url(PNG), "invalid_video"),
    (as_data_url(CLIP, "image/png"), "invalid_video_url"),
    ("data:video/mp4;base64,!!!", "invalid_video_url"),
    ("data:video/mp4," + base64.b64encode(CLIP).decode(), "invalid_video_url"),
    ("ftp://example.com/v.mp4", "invalid_video_url"),
    ("file:///etc/passwd", "video_url_forbidden"),
    ("http://127.0.0.1/v.mp4", "video_url_forbidden"),
    ("http://169.254.169.254/latest", "video_url_forbidden"),
])
def test_bad_video_urls_and_bytes_are_400_naming_the_part(url: str, code: str) -> None:
    err = refused(part(url))
    assert (err.code, err.param) == (code, PARAM), err.message


# --- http(s) videos ----------------------------------------------------------------------------------------

def test_http_videos_are_fetched_asking_for_video_and_checked_by_type_and_size(server: CountingServer) -> None:
    accepts: list[str] = []

    def recording(route: Route) -> Route:
        def handle(h: BaseHTTPRequestHandler) -> None:
            accepts.append(h.headers.get("Accept", ""))
            route(h)
        return handle

    server.routes["/v.mp4"] = recording(serve(CLIP, "video/mp4"))
    server.routes["/page"] = serve(b"<html>", "text/html")
    server.routes["/png"] = serve(PNG, "image/png")
    cfg = config(allowed_media_domains=("127.0.0.1",), video_chunk_frames=4)
    assert only_video(prepared(part(server.url("/v.mp4")), cfg=cfg)).data == CLIP and accepts == ["video/*"]
    assert refused(part(server.url("/page")), cfg=cfg).code == "invalid_video"  # refused by its type
    assert refused(part(server.url("/png")), cfg=cfg).code == "invalid_video"  # an image is not a video
    small = config(allowed_media_domains=("127.0.0.1",), max_video_bytes=len(CLIP) - 1)
    err = refused(part(server.url("/v.mp4")), cfg=small)
    assert err.code == "video_too_large" and err.param == PARAM
    assert refused(part(server.url("/missing.mp4")), cfg=cfg).code == "video_fetch_failed"


# --- prefix keys -------------------------------------------------------------------------------------------

def test_prefix_keys_name_a_video_by_its_hash_so_its_sampling_and_bytes_count() -> None:
    first = prepared(part(video_url())).prefix_keys
    assert prepared(part(video_url())).prefix_keys == first
    assert prepared(part(video_url()), mm_processor_kwargs={"fps": 1.0}).prefix_keys != first
    assert prepared(part(video_url(OTHER_CLIP))).prefix_keys != first
    image_instead = prepare_chat(request(image_part(as_data_url(PNG))), config(), video=QWEN2).prefix_keys
    assert image_instead != first


def test_remote_kinds_say_which_downloads_a_request_needs() -> None:
    assert remote_kinds(request(part(video_url()), image_part(as_data_url(PNG)))) == set()
    assert remote_kinds(request(part("HTTPS://example.com/v.mp4"), image_part(as_data_url(PNG)))) == {"video"}
    assert remote_kinds(request(part("http://e/v.mp4"), image_part("http://e/x.png"))) == {"video", "image"}
