"""`python -m proxy.example --video` (the README's video recipe): the clip it makes on the fly is a video the proxy
takes, and its request is prepared as one video part; tests/e2e/test_example_video.py sends it to a running stack."""
from __future__ import annotations

import base64

from epd_common.video import probe_video
from epd_common.video_sampling import VideoConfig, target_frames
from proxy.example import moving_square_clip, video_request
from proxy.prepare import prepare_chat
from proxy.protocol import ChatCompletionRequest
from proxy.video import VideoItem
from tests.proxy.media_helpers import config

QWEN2 = VideoConfig(sampler="qwen2", temporal_patch=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)


def test_the_example_video_request_is_one_video_the_proxy_prepares_with_every_frame() -> None:
    body = video_request("demo")
    url = body["messages"][0]["content"][0]["video_url"]["url"]
    clip = base64.b64decode(url.removeprefix("data:video/mp4;base64,"))
    chat = prepare_chat(ChatCompletionRequest.model_validate(body), config(), video=QWEN2)
    [item] = chat.items
    assert isinstance(item, VideoItem) and item.data == clip
    assert chat.messages[0]["content"] == [{"type": "video"}, {"type": "text", "text": "What happens in this video?"}]
    info = probe_video(clip)  # a well-formed MP4, sampled by the model's rule into at least one temporal patch
    assert item.video.count == item.video.total == target_frames(QWEN2, info, max_frames=config().max_video_frames)
    assert item.video.count >= QWEN2.temporal_patch
    assert (info.width, info.height, info.codec) == (64, 64, "h264")


def test_the_clip_is_made_to_measure() -> None:
    info = probe_video(moving_square_clip(num_frames=6, fps=3, size=32))
    assert (info.num_frames, info.fps, info.duration_s, info.width) == (6, 3.0, 2.0, 32)
