"""epd_common.video on good clips and on hostile files: every refusal is a VideoError, found before frames are
decoded where the headers or packets tell, and with bounded memory where only the decoder can tell."""
from __future__ import annotations

import io
import os
import random

import av
import numpy as np
import pytest

from epd_common.video import VideoError, VideoLimits, VideoTooLargeError, check_frame_size, probe_video
from epd_common.video_decode import decode_frames
from epd_common.video_sampling import sample_indices
from tests.factories import frame_number, make_image, make_video
from tests.hostile.memory import peak_rss_bytes, rss_bytes

CLIPS = [("mp4", "libx264", "h264"), ("matroska", "libx264", "h264"), ("mp4", "libx265", "hevc"),
         ("webm", "libvpx", "vp8"), ("webm", "libvpx-vp9", "vp9"), ("mp4", "libsvtav1", "av1"),
         ("avi", "mpeg4", "mpeg4"), ("mov", "mjpeg", "mjpeg")]  # (container, encoder, the codec probe_video names)


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_video(20)  # 96x48, 10 fps, H.264 in MP4


# --- good clips -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("container", "encoder", "codec"), CLIPS)
def test_probe_and_decode_give_the_asked_frames(container: str, encoder: str, codec: str) -> None:
    data = make_video(20, container=container, codec=encoder)
    info = probe_video(data)
    assert (info.width, info.height, info.fps, info.num_frames, info.codec) == (96, 48, 10.0, 20, codec)
    assert info.duration_s == pytest.approx(2.0)
    frames = decode_frames(data, [0, 3, 7, 19])
    assert [f.mode for f in frames] == ["RGB"] * 4 and frames[0].size == (96, 48)
    assert [frame_number(f) for f in frames] == [0, 3, 7, 19]


def test_frames_come_back_in_the_asked_order_with_repeats(clip: bytes) -> None:
    assert [frame_number(f) for f in decode_frames(clip, [9, 2, 2, 15])] == [9, 2, 2, 15]


def test_max_pixels_downscales_keeping_the_aspect(clip: bytes) -> None:
    frames = decode_frames(clip, [4, 12], max_pixels=48 * 24)
    assert [f.size for f in frames] == [(48, 24), (48, 24)]
    assert [frame_number(f) for f in frames] == [4, 12]


def test_sampled_indices_decode_to_those_frames(clip: bytes) -> None:
    info = probe_video(clip)
    indices = sample_indices(info, fps=2.0, min_frames=2, multiple_of=2)  # 2 s at 2 fps: 4 frames
    assert indices == [0, 5, 10, 15]
    assert [frame_number(f) for f in decode_frames(clip, indices)] == indices


# --- not a video -----------------------------------------------------------------------------------------------

def png_bytes() -> bytes:
    buf = io.BytesIO()
    make_image(32, 32).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("data", [b"", os.urandom(4096), png_bytes(), b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n"],
                         ids=["empty", "random", "png", "hls-playlist"])
def test_what_is_not_a_video_is_refused(data: bytes) -> None:
    with pytest.raises(VideoError):
        probe_video(data)
    with pytest.raises(VideoError):
        decode_frames(data, [0])


@pytest.mark.parametrize("container", ["nut", "flv", "mpegts"])
def test_containers_outside_the_allow_list_are_refused(container: str) -> None:
    with pytest.raises(VideoError, match="cannot identify video data"):
        probe_video(make_video(3, container=container))


def test_codecs_outside_the_allow_list_are_refused() -> None:
    with pytest.raises(VideoError, match="unsupported video codec 'ffv1'"):
        probe_video(make_video(3, container="matroska", codec="ffv1"))


def test_audio_only_is_refused() -> None:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    with pytest.raises(VideoError, match="no video stream"):
        probe_video(buf.getvalue())


# --- truncated or corrupt ----------------------------------------------------------------------------------------

def test_truncated_mp4_is_refused(clip: bytes) -> None:
    with pytest.raises(VideoError):  # the index (moov) is written last, so nothing can be read
        probe_video(clip[: len(clip) * 6 // 10])


@pytest.mark.parametrize("kept", [0.6, 0.8, 0.9, 0.95])
def test_truncated_avi_is_refused(kept: float) -> None:
    data = make_video(20, container="avi", codec="mpeg4")
    with pytest.raises(VideoError, match="cannot identify|corrupt|header declares 20 frames"):
        probe_video(data[: int(len(data) * kept)])


def test_truncated_matroska_is_the_shorter_video_it_holds() -> None:
    data = make_video(20, container="matroska")
    cut = data[: len(data) * 8 // 10]  # Matroska declares no frame count: nothing tells this from a short video
    info = probe_video(cut)
    assert 0 < info.num_frames < 20
    assert frame_number(decode_frames(cut, [info.num_frames - 1])[0]) == info.num_frames - 1
    with pytest.raises(VideoError, match="video ended after"):
        decode_frames(cut, [0, 19])  # frames past the cut are an error, never a shorter list


def test_damaged_bytes_give_a_video_error_or_the_asked_frames(clip: bytes) -> None:
    rng = random.Random(17)
    for _ in range(60):
        data = bytearray(clip)
        at = rng.randrange(len(data) - 16)
        data[at: at + rng.randint(1, 16)] = rng.randbytes(16)[: rng.randint(1, 16)]
        try:
            frames = decode_frames(bytes(data), [0, 10, 19])
        except VideoError:
            continue
        assert len(frames) == 3 and all(f.mode == "RGB" for f in frames)


# --- limits ----------------------------------------------------------------------------------------------------

def test_bytes_over_the_limit_are_refused_before_ffmpeg_reads_them(clip: bytes) -> None:
    with pytest.raises(VideoTooLargeError, match=f"{len(clip)} bytes; the limit is {len(clip) - 1}"):
        probe_video(clip, VideoLimits(max_bytes=len(clip) - 1))


@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_a_video_longer_than_the_limit_is_refused(container: str) -> None:
    data = make_video(8, width=16, height=16, fps=0.01, container=container)  # 8 frames, 100 s apart
    assert len(data) < 4096
    with pytest.raises(VideoTooLargeError, match="lasts 800.0 s; the limit is 600 s"):
        probe_video(data)


@pytest.mark.parametrize(("container", "num_streams"), [("matroska", 20), ("mp4", 9)])
def test_too_many_streams_are_refused(container: str, num_streams: int) -> None:
    with pytest.raises(VideoTooLargeError, match="more than 8 streams"):
        probe_video(make_video(2, width=16, height=16, container=container, num_streams=num_streams))


def test_eight_streams_are_accepted() -> None:
    assert probe_video(make_video(2, width=16, height=16, num_streams=8)).num_frames == 2


def test_frames_over_the_pixel_limit_are_refused_from_the_header() -> None:
    data = make_video(1, width=4096, height=2048)  # 8.4 M pixels, a few KB
    with pytest.raises(VideoTooLargeError, match="4096x2048 pixels; the limit is 4147200"):
        probe_video(data)
    with pytest.raises(VideoTooLargeError):
        decode_frames(data, [0])


@pytest.mark.parametrize(("width", "height"), [(0, 48), (96, -1), (70_000, 1), (1, 65_536)])
def test_absurd_frame_sides_are_refused(width: int, height: int) -> None:
    with pytest.raises(VideoError, match="each side must be 1..65535"):
        check_frame_size(width, height, max_pixels=10**12)


def test_a_container_declaring_zero_width_is_refused() -> None:
    data = make_video(4, width=256, height=64, container="webm", codec="libvpx")
    assert data.count(b"\xb0\x82\x01\x00") == 1  # Matroska PixelWidth = 256
    with pytest.raises(VideoError):
        probe_video(data.replace(b"\xb0\x82\x01\x00", b"\xb0\x82\x00\x00"))


def test_a_bitstream_larger_than_its_container_is_refused_before_allocation() -> None:
    data = bytearray(make_video(4, width=256, height=64, container="webm", codec="libvpx"))
    at = data.find(b"\x9d\x01\x2a")  # the VP8 key frame start code, then 14-bit width and height
    data[at + 3: at + 7] = (10_000).to_bytes(2, "little") * 2  # 100 M pixels: 150 MB per picture
    assert probe_video(bytes(data)).width == 256  # the container still says 256x64
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident memory (VmHWM) to the current one
    before = rss_bytes()
    with pytest.raises(VideoError):
        decode_frames(bytes(data), [0])
    assert peak_rss_bytes() - before < 32 * 1024 * 1024


def test_more_frames_than_the_scan_limit_are_refused(clip: bytes) -> None:
    limits = VideoLimits(max_scan_frames=10)
    with pytest.raises(VideoTooLargeError, match="more than 10 frames"):
        probe_video(clip, limits)
    with pytest.raises(VideoTooLargeError, match="indices must be in 0..9"):
        decode_frames(clip, [0, 12], limits)


def test_decode_refuses_too_many_frames_or_pixels(clip: bytes) -> None:
    with pytest.raises(VideoTooLargeError, match="3 frames asked for; the limit is 2"):
        decode_frames(clip, [0, 1, 2], VideoLimits(max_frames=2))
    with pytest.raises(VideoTooLargeError, match="pass the limit of 9000 pixels"):
        decode_frames(clip, [0, 1], VideoLimits(max_total_pixels=9000))  # 2 x 4608
    assert len(decode_frames(clip, [0, 1], VideoLimits(max_total_pixels=9216))) == 2
    with pytest.raises(VideoError, match="no frame asked for"):
        decode_frames(clip, [])


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_frames must be > 0"):
        VideoLimits(max_frames=0)
