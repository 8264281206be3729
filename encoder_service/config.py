"""Encoder worker configuration (CLI flags map one to one)."""
from __future__ import annotations

from dataclasses import dataclass, field

from connector.control.security import CurveConfig
from connector.tensors.get_limits import MAX_REPLY_BYTES
from connector.tensors.waiters import MAX_PARKED, MAX_PARKED_HASHES
from epd_common.audio_limits import AudioLimits as _AudioLimits
from epd_common.lora_flags import LoRAModule
from epd_common.server import HttpLimits
from epd_common.tracing import TraceSettings
from epd_common.video import VideoLimits

DEFAULT_LIMITS = VideoLimits()

MAX_ITEMS_PER_REQUEST = 64  # the proxy sends at most its --max-images-per-request (16) per call
MAX_ENCODE_BYTES = 320 << 20  # decoded image bytes per /encode: 16 images at the proxy's 20 MiB cap
MAX_ITEMS_PER_GET = 256


@dataclass(frozen=True)
class EncoderConfig(HttpLimits, TraceSettings):
    model: str = "demo"
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    dtype: str = "auto"  # auto (the checkpoint's), float32, bfloat16, float16
    host: str = "127.0.0.1"
    port: int = 8100
    ec_bind: str = "tcp://127.0.0.1:0"  # ZeroMQ endpoint the producer serves embeddings on
    ec_events_bind: str | None = None  # ZeroMQ PUB endpoint for cache events; None: beside ec_bind
    ec_cache_bytes: int = 1 << 30  # bytes of held embeddings, shared-memory segments included
    ec_shm: str = "auto"  # auto: hold embeddings in shared memory same-host decoders map; off: heap, socket only
    ec_advertise_host: str | None = None  # host decoders and proxies reach the ZeroMQ endpoints at (0.0.0.0 binds)
    ec_disk_dir: str | None = None  # every embedding also written here, kept through restarts; None: memory only
    ec_disk_bytes: int = 16 << 30  # bytes of files the disk tier keeps (LRU)
    # bytes of stored embeddings no decoder has gathered yet past which /encode answers 503; None: ec_cache_bytes / 2
    max_ungathered_bytes: int | None = None
    max_batch_size: int = 16  # images per vision forward of one call (the in-process path, execute_mm_encoder)
    max_encode_batch_items: int = 16  # items per vision forward, across calls
    max_encode_batch_tokens: int = 16384  # vision tokens per vision forward (an item larger still runs, alone)
    max_pending_encode_tokens: int = 1 << 18  # vision tokens waiting for the encode thread; more: 503 encoder_busy
    max_image_pixels: int = 40_000_000
    max_items_per_request: int = MAX_ITEMS_PER_REQUEST  # items per /encode; more get a 400
    max_encode_bytes: int = MAX_ENCODE_BYTES  # decoded image (and video) bytes per /encode; more get a 413
    # videos (epd_common.video.VideoLimits; one video's bytes are bounded by max_encode_bytes)
    max_video_duration: float = DEFAULT_LIMITS.max_duration_s  # seconds; longer: 400 video_too_large
    max_video_frames: int = DEFAULT_LIMITS.max_frames  # sampled frames of one video; more: 400 video_too_large
    max_video_frame_pixels: int = DEFAULT_LIMITS.max_pixels_per_frame  # source frame width * height
    max_video_decode_frames: int = DEFAULT_LIMITS.max_decode_frames  # frames decoded for one video item
    max_audio_seconds: float = _AudioLimits.max_seconds  # seconds of one audio clip; longer: 400 audio_too_large
    ec_max_items_per_get: int = MAX_ITEMS_PER_GET  # hashes one ZeroMQ get may ask for; more get an error reply
    ec_max_reply_bytes: int = MAX_REPLY_BYTES  # tensor bytes of one get reply; items past it are answered not found
    ec_max_parked_gets: int = MAX_PARKED  # gets waiting for items still encoding; more are answered at once
    ec_max_parked_hashes: int = MAX_PARKED_HASHES  # hashes those parked gets hold in all
    log_level: str = "info"
    internal_key: str | None = field(default=None, repr=False)  # Bearer key /encode requires
    curve: CurveConfig | None = None  # CURVE keys for connector links (flags --ec-curve-*)
    # the HTTP server's limits are inherited (HttpLimits); /encode carries base64 images, so the body cap fits the
    # proxy's defaults: 16 images of 20 MiB, base64 (4/3), plus 1 MiB of JSON
    max_body_bytes: int = 16 * (20 << 20) * 4 // 3 + (1 << 20)
    insecure: bool = False  # start without the internal key / CURVE keys (logs a WARNING)
    # LoRA adapters' vision-tower weights (encoder_service/lora.py), the decoders' --lora-modules
    enable_lora: bool = False
    lora_modules: tuple[LoRAModule, ...] = ()
    max_lora_rank: int = 16

    @property
    def ungathered_limit(self) -> int:
        return self.max_ungathered_bytes or self.ec_cache_bytes // 2

    @property
    def curve_needs(self) -> tuple[str, ...]:
        """CURVE keys this worker needs to start secure (see connector.control.curve_flags.curve_gaps)."""
        return ("secret_key", "allowed_clients")

    def __post_init__(self) -> None:
        assert self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unsupported dtype {self.dtype!r}"
        assert self.max_batch_size >= 1, "max_batch_size must be >= 1"
        assert min(self.max_encode_batch_items, self.max_encode_batch_tokens, self.max_pending_encode_tokens) >= 1, \
            "max_encode_batch_items, max_encode_batch_tokens and max_pending_encode_tokens must be >= 1"
        assert self.ec_cache_bytes > 0 and self.ec_disk_bytes > 0, "ec_cache_bytes and ec_disk_bytes must be > 0"
        assert self.max_ungathered_bytes is None or self.max_ungathered_bytes > 0, "max_ungathered_bytes must be > 0"
        assert self.ec_shm in ("auto", "off"), f"ec_shm must be auto or off, got {self.ec_shm!r}"
        assert self.max_items_per_request >= 1 and self.max_encode_bytes >= 1, \
            "max_items_per_request and max_encode_bytes must be >= 1"
        assert self.max_video_duration > 0 and min(self.max_video_frames, self.max_video_frame_pixels,
                                                   self.max_video_decode_frames) >= 1, \
            "max_video_duration, max_video_frames, max_video_frame_pixels and max_video_decode_frames must be > 0"
        assert self.max_audio_seconds > 0, "max_audio_seconds must be > 0"
        assert min(self.ec_max_items_per_get, self.ec_max_reply_bytes, self.ec_max_parked_gets,
                   self.ec_max_parked_hashes) >= 1, "ec_max_* limits must be >= 1"
        super().__post_init__()
