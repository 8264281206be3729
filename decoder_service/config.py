"""Decoder worker configuration (CLI flags map one to one)."""
from __future__ import annotations

from dataclasses import dataclass, field

from connector.control.security import CurveConfig
from decoder_service.engine.spec.config import SpecConfig
from epd_common.audio_limits import AudioLimits as _AudioLimits
from epd_common.lora_flags import LoRAModule
from epd_common.server import HttpLimits
from epd_common.tracing import TraceSettings
from epd_common.video import VideoLimits

DEFAULT_LIMITS = VideoLimits()


@dataclass(frozen=True)
class DecoderConfig(HttpLimits, TraceSettings):
    model: str = "demo"
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    dtype: str = "auto"  # auto (the checkpoint's), float32, bfloat16, float16
    quantization: str | None = None  # None: the checkpoint's quantization_config (epd_models/quant)
    quantized_weights: str = "auto"  # auto: kept quantized on CUDA, dequantized once at load on the CPU
    host: str = "127.0.0.1"
    port: int = 8200
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    max_queued: int = 256  # requests waiting for a slot; more get 503
    max_num_seqs: int = 32  # sequences decoded together (an upper bound on rows per step)
    # rows one request's n choices hold at once (the rest are admitted as its rows free up); 0: max_num_seqs // 2
    max_seqs_per_request: int = 0
    block_size: int = 16  # tokens per K/V block: the pool's unit, and a prefix is reused in whole blocks
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU's memory for weights, activations and K/V
    kv_cache_memory: int = 0  # bytes of the K/V pool; 0: from gpu_memory_utilization (CUDA), 1/4 of RAM (CPU)
    max_num_batched_tokens: int = 0  # tokens per step (prefill chunks + decode rows); 0: max(2048, max_num_seqs)
    enforce_eager: bool = False  # CUDA: run every step eagerly (no CUDA graphs)
    # ranks the language model is split over (decoder_service/engine/tp): this process is rank 0 and starts the
    # others; CUDA: rank r on the device after --device's r places (NCCL), CPU: gloo
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0  # seconds one collective may wait for a rank; past it the decoder exits
    # CPU: F.linear (MKL) for every linear, bit-equal with transformers; default: fp32 linears through oneDNN's
    # prepacked weights (decoder_service/engine/cpu_linear.py: faster, the last bits differ)
    cpu_exact_linear: bool = False
    # CPU: decode attention gathers the rows' blocks and runs torch's SDPA; default: the in-place kernel
    # (decoder_service/engine/cpu_attention.py), where it builds
    cpu_sdpa_attention: bool = False
    # prompt tokens prefilled per step while streams decode; 0: no cap of its own, a step packs prompt chunks up to
    # num_batched_tokens less its decode rows (vLLM's chunked prefill)
    max_prefill_tokens: int = 0
    # vLLM's --speculative-config JSON, checked (decoder_service/engine/spec/config.py); None: one token per step
    speculative_config: SpecConfig | None = None
    # LoRA adapters (decoder_service/lora.py), vLLM's flags: requests select one by name; least recently used evicted
    enable_lora: bool = False
    lora_modules: tuple[LoRAModule, ...] = ()
    max_loras: int = 1  # adapters resident at once
    max_lora_rank: int = 16  # a larger rank is refused
    max_cpu_loras: int = 0  # adapters known (host memory), resident or not; 0: max_loras
    enable_lora_runtime_updating: bool = False  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    allowed_lora_dir: str | None = None  # the folder runtime loads read from; None: runtime loads are refused
    # modality -> adapter folder applied to requests naming none (decoder_service/lora_defaults.py); None: the
    # checkpoint's own (Phi-4-multimodal's speech-lora, vision-lora), () none
    default_mm_loras: tuple[tuple[str, str], ...] | None = None
    gather_timeout: float = 10.0  # seconds to fetch embeddings from encoders
    ec_cache_bytes: int = 1 << 30  # local cache of gathered embeddings (shared-memory items mapped count too)
    ec_shm: str = "auto"  # auto: map same-host encoders' shared memory after a probe; off: socket only
    prefix_cache_bytes: int = 1 << 30  # cached prefix blocks no sequence references, kept for reuse (LRU); 0: off
    ec_max_reply_bytes: int = 1 << 30  # tensor bytes of one ZeroMQ reply (at least one whole item); more: refused
    ec_max_message_bytes: int = 1 << 30  # bytes of one tensor frame; a producer sending more is disconnected
    ec_max_items_per_get: int = 256  # hashes asked of one producer per get (at most the encoders' limit)
    aggregated: bool = False  # also load the vision half and encode images sent inline (no encoders)
    max_image_pixels: int = 40_000_000  # aggregated mode: larger images get a 400
    # aggregated mode: videos (epd_common.video.VideoLimits; one video's bytes are bounded by max_body_bytes)
    max_video_duration: float = DEFAULT_LIMITS.max_duration_s  # seconds; longer: 400 video_too_large
    max_video_frames: int = DEFAULT_LIMITS.max_frames  # sampled frames of one video; more: 400 video_too_large
    max_video_frame_pixels: int = DEFAULT_LIMITS.max_pixels_per_frame  # source frame width * height
    max_video_decode_frames: int = DEFAULT_LIMITS.max_decode_frames  # frames decoded for one video item
    max_audio_seconds: float = _AudioLimits.max_seconds  # seconds of one audio clip; longer: 400 audio_too_large
    engine_stall_timeout: float = 120.0  # seconds the engine loop may go without an iteration; then 503 + exit
    grammar_compile_threads: int = 2  # threads compiling response_format / tool grammars (no other request waits)
    grammar_compile_timeout: float = 10.0  # seconds one compile may run; then that request's 400 schema_too_complex
    # E -> P -> D (decoder_service/handoff.py): both (prefill and decode its own requests), prefill (also hands
    # requests off after their first token: K/V served on kv_bind), decode (also continues hand-offs)
    role: str = "both"
    kv_bind: str = "tcp://127.0.0.1:0"  # prefill: the ZeroMQ endpoint decode workers fetch K/V blocks from
    kv_advertise_host: str | None = None  # prefill: the host other machines reach kv_bind at (0.0.0.0 binds)
    kv_store_bytes: int = 4 << 30  # prefill: bytes of handed-off K/V kept for pickup (oldest dropped first)
    kv_ttl: float = 30.0  # prefill: seconds handed-off K/V is kept; a decode worker later prefills it itself
    # prefill: a prompt with fewer tokens not in this worker's prefix cache is declined (the decode worker prefills
    # it: splitting it would cost its stream a hand-off for a prefill shorter than one); 0 hands off every prompt
    handoff_min_tokens: int = 512
    log_level: str = "info"
    internal_key: str | None = field(default=None, repr=False)  # Bearer key /generate requires
    curve: CurveConfig | None = None  # CURVE keys for connector links (flags --ec-curve-*)
    insecure: bool = False  # start without the internal key / CURVE keys (logs a WARNING)
    # the HTTP server's limits are inherited (HttpLimits). /generate carries the messages of a proxy request (its
    # body is capped at 64 MiB) and, aggregated, its images inline: 0 picks 80 MiB, or 16 images of 20 MiB in
    # base64 plus 1 MiB when aggregated
    max_body_bytes: int = 0

    @property
    def curve_needs(self) -> tuple[str, ...]:
        """CURVE keys this worker needs to start secure (curve_flags.curve_gaps); aggregated: no ZeroMQ peers."""
        return () if self.aggregated else ("secret_key", "server_key")

    @property
    def prefix_block_size(self) -> int:
        """Tokens per cached prefix block: the pool's blocks (--prefix-block-size is an alias of --block-size)."""
        return self.block_size

    @property
    def seqs_per_request(self) -> int:
        """Rows one request may hold at once: the flag, or half of --max-num-seqs (at least 1)."""
        return self.max_seqs_per_request or max(1, self.max_num_seqs // 2)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens one step may run (prefill chunks + decode rows): the flag, or vLLM's default max(2048, seqs)."""
        return self.max_num_batched_tokens or max(2048, self.max_num_seqs)

    def __post_init__(self) -> None:
        assert self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unsupported dtype {self.dtype!r}"
        assert self.max_model_len >= 0, "max_model_len must be >= 0"
        assert self.gather_timeout > 0, "gather_timeout must be > 0"
        assert self.ec_shm in ("auto", "off"), f"ec_shm must be auto or off, got {self.ec_shm!r}"
        assert self.max_num_seqs >= 1, "max_num_seqs must be >= 1"
        assert self.max_prefill_tokens >= 0, "max_prefill_tokens must be >= 0 (0: the step's token budget)"
        assert 0 <= self.max_seqs_per_request <= self.max_num_seqs, \
            "max_seqs_per_request must be 0 (max_num_seqs // 2) or at most max_num_seqs"
        assert self.engine_stall_timeout > 0, "engine_stall_timeout must be > 0"
        assert self.grammar_compile_threads >= 1 and self.grammar_compile_timeout > 0, \
            "grammar_compile_threads must be >= 1 and grammar_compile_timeout > 0"
        assert self.max_video_duration > 0 and min(self.max_video_frames, self.max_video_frame_pixels,
                                                   self.max_video_decode_frames) >= 1, \
            "max_video_duration, max_video_frames, max_video_frame_pixels and max_video_decode_frames must be > 0"
        assert self.max_audio_seconds > 0, "max_audio_seconds must be > 0"
        assert self.prefix_cache_bytes >= 0, "prefix_cache_bytes must be >= 0 (0: off)"
        assert self.block_size >= 1, "block_size must be >= 1"
        assert self.role in ("both", "prefill", "decode"), f"role must be both, prefill or decode, got {self.role!r}"
        assert self.kv_store_bytes >= 1 and self.kv_ttl > 0, "kv_store_bytes and kv_ttl must be > 0"
        assert self.handoff_min_tokens >= 0, "handoff_min_tokens must be >= 0"
        assert 0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"
        assert self.kv_cache_memory >= 0, "kv_cache_memory must be >= 0 (0: automatic)"
        assert self.max_num_batched_tokens == 0 or self.max_num_batched_tokens >= self.max_num_seqs, \
            "max_num_batched_tokens must be 0 (automatic) or >= max_num_seqs (every running row decodes each step)"
        if self.max_body_bytes == 0:  # frozen: the resolved default is set once, here
            auto = 16 * (20 << 20) * 4 // 3 + (1 << 20) if self.aggregated else 80 << 20
            object.__setattr__(self, "max_body_bytes", auto)
        super().__post_init__()
