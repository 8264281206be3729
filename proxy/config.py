"""Proxy configuration (CLI flags map one to one)."""
from __future__ import annotations

from dataclasses import dataclass, field

from connector.control.security import CurveConfig
from epd_common.server import HttpLimits
from epd_common.tracing import TraceSettings
from epd_common.video import VideoLimits
from epd_contracts.video import MAX_VIDEO_FRAMES


@dataclass(frozen=True)
class ProxyConfig(HttpLimits, TraceSettings):
    encode_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    # E -> P -> D: decoders started with --role prefill; a request prefills there (its first token streamed from
    # there), then a decode worker continues it from the handed-off K/V. Empty: E + PD (each decoder prefills)
    prefill_urls: tuple[str, ...] = ()
    served_model_name: str | None = "demo"  # None: the model the workers report (Workers.model_name)
    host: str = "127.0.0.1"
    port: int = 8000
    max_images_per_request: int = 16
    max_image_bytes: int = 20 << 20  # one decoded image file
    # the HTTP server's limits (max_body_bytes, timeouts, connections) are inherited from HttpLimits
    max_image_pixels: int = 40_000_000
    # videos (proxy/video.py): each one is probed (headers and packets, no frame decoded) under these limits
    max_videos_per_request: int = 4
    max_video_bytes: int = 64 << 20  # one video file
    max_video_duration: float = 600.0  # seconds
    max_video_frames: int = 256  # frames sampled from one video (a request's num_frames above it: 400)
    max_video_frame_pixels: int = VideoLimits.max_pixels_per_frame  # source frame width * height
    video_chunk_frames: int = 16  # sampled frames per chunk: the unit one encoder encodes (whole temporal patches)
    # every chunk's /encode call carries the whole file: a video gets at most this many bytes over all its chunks
    # (a larger file is cut into fewer, longer chunks), so one upload cannot be multiplied into gigabytes of calls
    max_video_fanout_bytes: int = 256 << 20
    # frames the encoders decode for one request's videos, each chunk from the keyframe before its first frame
    # (planned from the probe's packet index before anything is encoded): one pass over a 600 s 60 fps video
    # plus a 250-frame GOP for each of 48 chunks
    max_video_decode_frames: int = 48_000
    # audio (proxy/audio.py): input_audio and audio_url parts, for a model whose workers report that it takes audio
    max_audios_per_request: int = 4
    max_audio_bytes: int = 25 << 20  # one audio file (OpenAI's cap: 25 MB)
    max_audio_seconds: float = 600.0  # one clip's duration
    # seconds per chunk of a clip, where the family encodes windows apart (whole windows; epd_contracts/audio.py)
    audio_chunk_seconds: float = 30.0
    # bytes one clip may send to encoders over all its chunks (each chunk's call carries the whole file): a larger
    # file is cut into fewer, longer chunks
    max_audio_fanout_bytes: int = 64 << 20
    # media fetching: http(s) image URLs to private/loopback hosts and local files are refused unless allowed
    allowed_local_media_path: str | None = None  # file:// URLs only under this directory
    allowed_media_domains: tuple[str, ...] = ()  # hosts (names or IPs) fetched even if they resolve privately
    media_fetch_timeout: float = 10.0  # seconds: connect, and each read, of one image download
    media_fetch_deadline: float = 30.0  # seconds to load all of one request's images (slot wait included)
    max_concurrent_fetches: int = 16  # http(s) image downloads at once, all requests together
    worker_timeout: float = 300.0  # seconds for one encode call or one generation
    # seconds an encode may wait while every encoder answers 503 encoder_busy (each try goes to another encoder
    # first; when all are busy, the next try waits the answer's Retry-After); then 503 encoders_saturated
    encoder_busy_timeout: float = 30.0
    startup_timeout: float = 300.0  # seconds to wait for workers at start
    log_level: str = "info"
    # send the decode request as soon as encodes are scheduled; the decoder's gather waits for them
    pipeline_encode: bool = False
    # no encoders: decoders run in aggregated mode and get the image bytes inline (the baseline deployment)
    aggregated: bool = False
    api_key: str | None = field(default=None, repr=False)  # Bearer key clients must send on /v1/*
    # Bearer key for the internal side: sent to workers' /encode and /generate, required on /instances
    internal_key: str | None = field(default=None, repr=False)
    dynamic_registration: bool = False  # workers may be added and removed at run time (POST/DELETE /instances)
    # attach mode run open (--insecure, a key waived): GET /instances lists the workers without the internal key;
    # POST/DELETE still need it
    insecure: bool = False
    health_interval: float = 2.0  # seconds between probes of each worker's /health
    health_timeout: float = 2.0  # seconds one probe may take
    health_failures: int = 3  # failed probes in a row that take a worker out
    # prefix affinity (scheduler/affinity.py): a conversation goes to the decoder holding its longest prompt prefix
    # unless that decoder has more than `affinity_load_gap` generations in flight over the least-loaded one
    prefix_affinity: bool = True
    affinity_load_gap: int = 4
    curve: CurveConfig | None = None  # CURVE keys for the proxy's connector links (cache events, snapshots)

    def __post_init__(self) -> None:
        if self.dynamic_registration:
            if not self.internal_key:
                raise ValueError("--dynamic-registration needs --internal-key (it guards /instances)")
        elif not self.decode_urls or not (self.encode_urls or self.aggregated):
            raise ValueError("the proxy needs at least one decoder URL and, unless aggregated, one encoder URL")
        assert self.health_interval > 0 and self.health_timeout > 0 and self.health_failures >= 1
        assert self.affinity_load_gap >= 0, "affinity_load_gap must be >= 0"
        assert self.max_images_per_request >= 0, "max_images_per_request must be >= 0"
        assert self.max_videos_per_request >= 0, "max_videos_per_request must be >= 0"
        assert self.max_video_bytes >= 1 and self.max_video_duration > 0 and self.max_video_frame_pixels >= 1, \
            "max_video_bytes, max_video_duration and max_video_frame_pixels must be > 0"
        assert 1 <= self.max_video_frames <= MAX_VIDEO_FRAMES, f"max_video_frames must be in 1..{MAX_VIDEO_FRAMES}"
        assert self.video_chunk_frames >= 1, "video_chunk_frames must be >= 1"
        assert self.max_video_fanout_bytes >= 1, "max_video_fanout_bytes must be >= 1"
        assert self.max_video_decode_frames >= 1, "max_video_decode_frames must be >= 1"
        assert self.max_audios_per_request >= 0, "max_audios_per_request must be >= 0"
        assert self.max_audio_bytes >= 1 and self.max_audio_seconds > 0, \
            "max_audio_bytes and max_audio_seconds must be > 0"
        assert self.audio_chunk_seconds > 0 and self.max_audio_fanout_bytes >= 1, \
            "audio_chunk_seconds and max_audio_fanout_bytes must be > 0"
        assert self.media_fetch_deadline > 0 and self.max_concurrent_fetches >= 1, \
            "media_fetch_deadline must be > 0 and max_concurrent_fetches >= 1"
        super().__post_init__()
