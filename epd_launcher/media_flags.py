"""disagg-epd-proxy's limits on the media of one request: images, videos and audio clips (the proxy's checks before
anything is fetched or encoded)."""
from __future__ import annotations

import argparse

from epd_common.cli import non_negative, positive_seconds
from epd_launcher.flag_types import positive, video_frames
from proxy.config import ProxyConfig


def add_image_flags(g: argparse._ActionsContainer) -> None:
    g.add_argument("--max-images-per-request", type=int, default=16, help="more images get a 400")
    g.add_argument("--max-image-bytes", type=int, default=20 << 20, help="bytes of one image file")
    g.add_argument("--max-image-pixels", type=int, default=40_000_000, help="larger images get a 400")
    g.add_argument("--allowed-local-media-path", default=None,
                   help="serve file:// image URLs from under this directory (default: file URLs are refused)")
    g.add_argument("--allowed-media-domains", nargs="+", default=[],
                   help="hosts whose http(s) image URLs are fetched even when they resolve to loopback, private "
                        "or link-local addresses (default: such addresses are refused before connecting)")
    g.add_argument("--media-fetch-timeout", type=float, default=10.0,
                   help="seconds to connect, and per read, when downloading an image URL")
    g.add_argument("--media-fetch-deadline", type=float, default=30.0,
                   help="seconds to load all of one request's images, waiting for a fetch slot included; past it "
                        "the download is aborted and the request gets a 408 naming the image")
    g.add_argument("--max-concurrent-fetches", type=int, default=16,
                   help="http(s) image downloads at once over all requests; a request that gets no slot within "
                        "its --media-fetch-deadline gets a 503")


def add_video_flags(g: argparse._ActionsContainer) -> None:
    defaults = ProxyConfig.__dataclass_fields__
    g.add_argument("--max-videos-per-request", type=non_negative, default=defaults["max_videos_per_request"].default,
                   help="more videos get a 400 too_many_videos, counted before any is loaded")
    g.add_argument("--max-video-bytes", type=positive, default=defaults["max_video_bytes"].default,
                   help="bytes of one video file (default 64 MiB)")
    g.add_argument("--max-video-duration", type=positive_seconds, default=defaults["max_video_duration"].default,
                   help="seconds of one video")
    g.add_argument("--max-video-frames", type=video_frames, default=defaults["max_video_frames"].default,
                   help="frames sampled from one video: a sampling rate that would take more is clamped to it, a "
                        "request's mm_processor_kwargs.num_frames above it gets a 400")
    g.add_argument("--max-video-frame-pixels", type=positive, default=defaults["max_video_frame_pixels"].default,
                   help="width x height of the video's own frames (before any resize)")
    g.add_argument("--video-chunk-frames", type=positive, default=defaults["video_chunk_frames"].default,
                   help="sampled frames per chunk, the part of a video one encoder encodes (rounded down to whole "
                        "temporal patches): a longer video is spread over the encoders")
    g.add_argument("--max-video-fanout-bytes", type=positive, default=defaults["max_video_fanout_bytes"].default,
                   help="bytes one video may send to encoders over all its chunks (each chunk's call carries the "
                        "whole file): a larger file is cut into fewer, longer chunks (default 256 MiB)")
    g.add_argument("--max-video-decode-frames", type=positive, default=defaults["max_video_decode_frames"].default,
                   help="frames the encoders may decode for one request's videos, each chunk counted from the "
                        "keyframe before its first frame (planned before any encode); more: 400 video_too_large")


def add_audio_flags(g: argparse._ActionsContainer) -> None:
    defaults = ProxyConfig.__dataclass_fields__
    g.add_argument("--max-audios-per-request", type=non_negative, default=defaults["max_audios_per_request"].default,
                   help="more audio parts get a 400 too_many_audios, counted before any is loaded")
    g.add_argument("--max-audio-bytes", type=positive, default=defaults["max_audio_bytes"].default,
                   help="bytes of one audio file, base64-decoded or downloaded; more: 400 audio_too_large "
                        "(default 25 MiB)")
    g.add_argument("--max-audio-seconds", type=positive_seconds, default=defaults["max_audio_seconds"].default,
                   help="seconds of one audio clip; longer: 400 audio_too_large")
    g.add_argument("--audio-chunk-seconds", type=positive_seconds, default=defaults["audio_chunk_seconds"].default,
                   help="seconds of audio per chunk, the part of a clip one encoder encodes (whole windows of the "
                        "family's encoder, for families whose windows are encoded apart): a longer clip is spread "
                        "over the encoders")
    g.add_argument("--max-audio-fanout-bytes", type=positive, default=defaults["max_audio_fanout_bytes"].default,
                   help="bytes one clip may send to encoders over all its chunks (each chunk's call carries the "
                        "whole file): a larger file is cut into fewer, longer chunks (default 64 MiB)")

