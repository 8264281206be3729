"""Encoder worker configuration (CLI flags map one to one)."""
from __future__ import annotations

from dataclasses import dataclass, field

from connector.security import CurveConfig


@dataclass(frozen=True)
class EncoderConfig:
    model: str = "demo"
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    dtype: str = "auto"  # auto (the checkpoint's), float32, bfloat16, float16
    host: str = "127.0.0.1"
    port: int = 8100
    ec_bind: str = "tcp://127.0.0.1:0"  # ZeroMQ endpoint the producer serves embeddings on
    ec_events_bind: str | None = None  # ZeroMQ PUB endpoint for cache events; None: beside ec_bind
    ec_cache_bytes: int = 1 << 30
    ec_advertise_host: str | None = None  # host decoders and proxies reach the ZeroMQ endpoints at (0.0.0.0 binds)
    max_batch_size: int = 16  # images per vision forward
    max_image_pixels: int = 40_000_000
    log_level: str = "info"
    internal_key: str | None = field(default=None, repr=False)  # Bearer key /encode requires
    curve: CurveConfig | None = None  # CURVE keys for connector links (flags --ec-curve-*)

    def __post_init__(self) -> None:
        assert self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unsupported dtype {self.dtype!r}"
        assert self.max_batch_size >= 1, "max_batch_size must be >= 1"
        assert self.ec_cache_bytes > 0, "ec_cache_bytes must be > 0"
