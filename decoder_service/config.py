"""Decoder worker configuration (CLI flags map one to one)."""
from __future__ import annotations

from dataclasses import dataclass, field

from connector.security import CurveConfig


@dataclass(frozen=True)
class DecoderConfig:
    model: str = "demo"
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    dtype: str = "auto"  # auto (the checkpoint's), float32, bfloat16, float16
    host: str = "127.0.0.1"
    port: int = 8200
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    max_queued: int = 256  # requests waiting for a slot; more get 503
    max_num_seqs: int = 32  # sequences decoded together (KV slots preallocated for each)
    max_prefill_tokens: int = 32  # prompt tokens prefilled per step while streams decode (8x when none do)
    gather_timeout: float = 10.0  # seconds to fetch embeddings from encoders
    ec_cache_bytes: int = 1 << 30  # local cache of gathered embeddings
    aggregated: bool = False  # also load the vision half and encode images sent inline (no encoders)
    max_image_pixels: int = 40_000_000  # aggregated mode: larger images get a 400
    log_level: str = "info"
    internal_key: str | None = field(default=None, repr=False)  # Bearer key /generate requires
    curve: CurveConfig | None = None  # CURVE keys for connector links (flags --ec-curve-*)

    def __post_init__(self) -> None:
        assert self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unsupported dtype {self.dtype!r}"
        assert self.max_model_len >= 0, "max_model_len must be >= 0"
        assert self.gather_timeout > 0, "gather_timeout must be > 0"
        assert self.max_num_seqs >= 1 and self.max_prefill_tokens >= 1, "max_num_seqs and max_prefill_tokens >= 1"
