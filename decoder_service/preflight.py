"""What `epd-decoder` can refuse before the weights load (exit 2 with one line): the tracing extra, the model, a
quantized checkpoint it will not load, a speculative draft model, LoRA flags that cannot work together, the K/V
arithmetic."""
from __future__ import annotations

from pathlib import Path

from decoder_service.config import DecoderConfig
from decoder_service.lora import check_lora_flags
from epd_common.startup import ConfigError
from epd_common.tracing import require_sdk


def check_before_loading(cfg: DecoderConfig) -> None:
    """ConfigError for what can be told before the weights load: the tracing extra, the model, the K/V
    arithmetic."""
    from epd_models.resolve import resolve_model

    if cfg.otlp_traces_endpoint:
        require_sdk()
    try:
        model_dir = resolve_model(cfg.model)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    check_quantized(model_dir, cfg.quantization)
    check_lora_flags(cfg)
    if cfg.speculative_config is not None and cfg.speculative_config.model:
        check_draft_model(model_dir, cfg.speculative_config.model, cfg.speculative_config.method)
    check_kv_fits(model_dir, dtype=cfg.dtype, device=cfg.device, block_size=cfg.block_size,
                  max_model_len=cfg.max_model_len, kv_cache_memory=cfg.kv_cache_memory,
                  ranks=cfg.tensor_parallel_size)


def check_draft_model(model_dir: str | Path, draft: str, method: str = "draft_model") -> None:
    """ConfigError when --speculative-config's draft model (or EAGLE-3 heads) cannot be found, has another tokenizer
    (or does not fit this target)."""
    from decoder_service.engine.spec.draft import check_draft
    from decoder_service.engine.spec.eagle3 import check_head
    from epd_models.resolve import resolve_model

    try:
        (check_head if method == "eagle3" else check_draft)(model_dir, resolve_model(draft))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--speculative-config: {exc}") from None


def check_quantized(model_dir: str | Path, quantization: str | None) -> None:
    """ConfigError naming the config key or tensor of a quantized checkpoint EPD will not load, or a --quantization
    that disagrees with it (epd_models/quant/load.py: headers and scales only, no weight read)."""
    from epd_models.quant.load import check_checkpoint
    from epd_models.quant.scheme import QuantError

    try:
        check_checkpoint(model_dir, quantization)
    except (QuantError, ValueError) as exc:
        raise ConfigError(f"model {model_dir}: {exc}") from None


def check_kv_fits(model_dir: str | Path, *, dtype: str, device: str, block_size: int, max_model_len: int,
                  kv_cache_memory: int, ranks: int = 1) -> None:
    """ConfigError, with the engine's own message (decoder_service.engine.memory_plan), when an explicit
    --max-model-len cannot fit in an explicit --kv-cache-memory (one rank's pool at --tensor-parallel-size `ranks`),
    is past a longrope checkpoint's short factors (memory_plan.checkpoint_max_len), or when the model does not split
    over `ranks`; read from the checkpoint's config, no weights loaded. Either one left to its default (0) is settled only once the weights are loaded: nothing to check.
    On CUDA the GPU's free memory is not known yet, so only the arithmetic is checked (the engine checks the rest)."""
    if not max_model_len and ranks == 1:
        return
    import torch  # NOTE: here: the launcher and --help never need it

    from decoder_service.engine.kv_shape import KVShape
    from decoder_service.engine.memory_plan import KVPlanError, checkpoint_max_len, cpu_total_bytes, plan_kv_cache
    from epd_models.device import _dtype
    from epd_models.registry import load_config
    from epd_models.tensor_parallel import SplitError, check_split

    try:
        config = load_config(model_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {model_dir}: cannot read its config: {exc}") from None
    text = config.get_text_config()
    try:
        check_split(text, ranks)
        limit = checkpoint_max_len(text, max_model_len)
    except (SplitError, KVPlanError) as exc:
        raise ConfigError(f"model {model_dir}: {exc}") from None
    if not (max_model_len and kv_cache_memory):
        return
    where = torch.device("cuda" if device.startswith("cuda") else "cpu")
    total = cpu_total_bytes() if where.type == "cpu" else kv_cache_memory
    try:
        plan_kv_cache(KVShape.of(text, _dtype(config, dtype), ranks), block_size=block_size, requested_max_len=max_model_len,
                      checkpoint_max_len=limit, kv_cache_memory=kv_cache_memory,
                      device=where, gpu_memory_utilization=1.0, total_bytes=total, used_bytes=0)
    except KVPlanError as exc:
        raise ConfigError(str(exc)) from None
