"""epd-bench's videos: the PyAV clips (decodable, as asked, distinct by construction), the dataset's video slots
and what reaches the server (`video_url` parts and `mm_processor_kwargs.num_frames`), against the fake server."""
from __future__ import annotations

import base64
import io
from dataclasses import replace
from typing import Any

import av
import numpy as np
import pytest

from epd_bench.backends import RequestInput, _decoder_body
from epd_bench.dataset import DatasetSpec, build_dataset, repeat_share
from epd_bench.serve import run
from epd_bench.video_clip import check_clip_size, clip_frames, make_clip
from epd_common.video import VideoLimits, probe_video
from epd_common.video_decode import decode_frames
from tests.bench.conftest import FakeServer

SPEC = DatasetSpec(num_prompts=12, input_len=6, output_len=4, images_per_request=1, image_width=16, image_height=8,
                   repeat_ratio=0.5, seed=5, videos_per_request=2, video_frames=4, video_width=64, video_height=32,
                   video_fps=4.0)


def _clip(url: str) -> bytes:
    header, data = url.split(",", 1)
    assert header == "data:video/mp4;base64"
    return base64.b64decode(data)


def test_a_clip_is_the_frames_asked_for_and_shows_a_moving_square() -> None:
    data = make_clip(seed=3, video_id=9, num_frames=6, width=96, height=48, fps=3.0)
    info = probe_video(data, VideoLimits())
    assert (info.num_frames, info.width, info.height, info.fps, info.codec) == (6, 96, 48, 3.0, "h264")
    frames = [np.asarray(f.convert("RGB"), dtype=np.int32) for f in decode_frames(data, range(6), VideoLimits())]
    expected = clip_frames(3, 9, 6, 96, 48).astype(np.int32)
    assert all(np.abs(got - want).mean() < 8 for got, want in zip(frames, expected, strict=True))  # lossy H.264
    shape_columns = [np.nonzero((want != want[-1, 0]).any(axis=(0, 2)))[0] for want in expected[:, 8:]]
    assert [int(c.min()) for c in shape_columns] == sorted({int(c.min()) for c in shape_columns})  # left to right


def test_clips_are_distinct_by_seed_and_id_and_the_same_when_asked_again() -> None:
    one = make_clip(1, 2, 3, 64, 16, 2.0)
    assert make_clip(1, 2, 3, 64, 16, 2.0) == one
    assert len({one, make_clip(1, 3, 3, 64, 16, 2.0), make_clip(2, 2, 3, 64, 16, 2.0)}) == 3
    # two ids whose colours happen to match still differ in the strip that writes them
    a, b = clip_frames(0, 4, 1, 64, 16), clip_frames(0, 5, 1, 64, 16)
    assert (a[:, :2] != b[:, :2]).any()


@pytest.mark.parametrize(("width", "height"), [(63, 32), (64, 15), (62, 32), (64, 14)])
def test_sizes_h264_cannot_hold_are_refused(width: int, height: int) -> None:
    with pytest.raises(ValueError, match="even width"):
        check_clip_size(width, height)


def test_video_slots_follow_the_spec_and_leave_the_rest_of_the_dataset_alone() -> None:
    warm, requests = build_dataset(SPEC, num_warmups=2)
    no_videos = build_dataset(replace(SPEC, videos_per_request=0), num_warmups=2)
    assert [(r.prompt, r.images, r.output_len) for r in warm + requests] == \
        [(r.prompt, r.images, r.output_len) for r in no_videos[0] + no_videos[1]]
    assert all(r.videos == () and r.video_frames == 0 for r in no_videos[1])
    by_id: dict[int, str] = {}
    for r in requests:
        assert len(r.videos) == 2 and r.video_frames == 4 and len(set(r.video_ids)) == 2
        for i, url in zip(r.video_ids, r.videos, strict=True):
            assert by_id.setdefault(i, url) == url  # a repeat is the very same bytes
    assert len(set(by_id.values())) == len(by_id) and len(by_id) < 2 * len(requests)  # some repeated, all distinct
    info = probe_video(_clip(requests[0].videos[0]), VideoLimits())
    assert (info.num_frames, info.width, info.height, info.fps) == (4, 64, 32, 4.0)
    assert not {u for r in warm for u in r.videos} & set(by_id.values())  # warm-ups never send a measured video
    assert 0 < repeat_share(requests) < 1


def test_repeat_share_counts_images_and_videos_apart() -> None:
    _, requests = build_dataset(replace(SPEC, repeat_ratio=0.0, num_prompts=3))
    assert repeat_share(requests) == 0.0  # image 0 and video 0 are different things
    assert {i for r in requests for i in r.image_ids} & {i for r in requests for i in r.video_ids}


def bench(fake: FakeServer, *flags: str) -> dict[str, Any]:
    return run(["--base-url", fake.url, "--disable-tqdm", "--random-input-len", "4", "--random-output-len", "2",
                "--video-size", "64x32", *flags])


def test_videos_reach_the_server_as_video_url_parts_with_their_frame_count(fake_server: FakeServer) -> None:
    r = bench(fake_server, "--num-prompts", "2", "--images-per-request", "1", "--image-size", "16",
              "--videos-per-request", "1", "--video-frames", "6", "--video-fps", "3")
    assert r["completed"] == 2 and r["dataset"]["videos_per_request"] == 1
    for body in fake_server.bodies:
        (message,) = body["messages"]
        assert [p["type"] for p in message["content"]] == ["image_url", "video_url", "text"]
        assert probe_video(_clip(message["content"][1]["video_url"]["url"]), VideoLimits()).num_frames == 6
        assert body["mm_processor_kwargs"] == {"num_frames": 6}
    plain = bench(fake_server, "--num-prompts", "1", "--images-per-request", "0")
    assert plain["completed"] == 1 and "mm_processor_kwargs" not in fake_server.bodies[-1]


def test_extra_body_replaces_the_sampling_asked_for(fake_server: FakeServer) -> None:
    bench(fake_server, "--num-prompts", "1", "--images-per-request", "0", "--videos-per-request", "1",
          "--video-frames", "4", "--extra-body", '{"mm_processor_kwargs": {"fps": 1.0}}')
    assert fake_server.bodies[-1]["mm_processor_kwargs"] == {"fps": 1.0}


def test_a_conversation_sends_its_video_in_the_first_turn_and_its_frame_count_every_turn(
        fake_server: FakeServer) -> None:
    r = bench(fake_server, "--dataset", "multi-turn", "--conversations", "2", "--turns", "2",
              "--images-per-request", "0", "--videos-per-request", "1", "--video-frames", "4")
    assert r["completed"] == 4
    videos = set()
    for body in fake_server.bodies:
        first = body["messages"][0]["content"]
        assert [p["type"] for p in first] == ["video_url", "text"] and body["mm_processor_kwargs"] == {"num_frames": 4}
        videos.add(first[0]["video_url"]["url"])
    assert len(videos) == 2  # one per conversation, resent with its history


@pytest.mark.parametrize("bad", [
    ["--videos-per-request", "-1"],
    ["--videos-per-request", "1", "--video-frames", "0"],
    ["--videos-per-request", "1", "--video-fps", "0"],
    ["--videos-per-request", "1", "--video-size", "65x32"],
    ["--videos-per-request", "1", "--backend", "epd-decoder"],
])
def test_bad_video_flags_are_usage_errors(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["--base-url", "http://127.0.0.1:9", *bad])
    assert exc.value.code == 2 and "video" in capsys.readouterr().err


def test_a_clip_decodes_with_pyav_alone() -> None:
    """What a server that is not EPD sees: an MP4 any PyAV build reads, frame for frame."""
    with av.open(io.BytesIO(make_clip(0, 0, 5, 64, 16, 5.0)), "r") as container:
        assert len(list(container.decode(video=0))) == 5


def test_the_decoder_backend_refuses_a_video_rather_than_send_it_as_an_image() -> None:
    (sample,) = build_dataset(replace(SPEC, num_prompts=1))[1]
    with pytest.raises(ValueError, match="no videos"):
        _decoder_body(RequestInput(url="http://x", model="m", sample=sample))
