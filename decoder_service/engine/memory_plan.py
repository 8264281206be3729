"""How many K/V blocks a decoder gets, and how long one sequence may be, from a memory budget (vLLM's rule).

CUDA: pool = total x `--gpu-memory-utilization` - used, where used is measured (`cuda_budget`) after the weights are
loaded and one profiling forward ran: the caching allocator still holds that forward's peak, so activations count
as used. CPU: `--kv-cache-memory`, else `CPU_SHARE` of physical RAM (`cpu_total_bytes`). Blocks = pool // (block
size x bytes per token); block 0 is the null block padded block-table entries read, so one sequence gets at most
(blocks - 1) x block size positions. `--max-model-len` 0 takes the checkpoint's, lowered (with a warning) to that;
an explicit one that cannot fit is refused with the numbers (the CLI exits 2 with them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from decoder_service.engine.kv_shape import KVShape
from epd_models.tensor_parallel import local_forward

if TYPE_CHECKING:
    from decoder_service.engine.interfaces import EngineSettings
    from epd_models.halves import LanguageHalf

NULL_BLOCKS = 1  # block 0: always zero, read by padded block-table entries; never given to a sequence
# CPU default: a quarter of RAM. The pool's pages are touched only as blocks are used (torch.empty), so an idle
# decoder costs nothing; a full one leaves three quarters for its weights, the encoders the launcher starts beside
# it and the OS. It is also capped at CPU_HEADROOM of RAM minus the weights, so a large model on a small host gets
# a smaller pool instead of swapping. Several decoders on one host: give each --kv-cache-memory.
CPU_SHARE = 4
CPU_HEADROOM = 0.9
_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")  # a container's memory limit (cgroup v2), when it has one


class KVPlanError(ValueError):
    """The budget cannot hold what was asked (the message gives bytes per token, pool bytes, tokens that fit)."""


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int  # blocks the pool allocates, the null block included
    block_size: int  # tokens per block
    bytes_per_token: int  # K and V of every layer
    pool_bytes: int  # the budget the blocks were cut from (num_blocks x bytes per block <= pool_bytes)
    max_model_len: int  # positions of one sequence, prompt included
    source: str  # where the budget came from, for the start-up log
    warning: str | None = None  # max_model_len was lowered from the checkpoint's

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - NULL_BLOCKS

    @property
    def max_tokens(self) -> int:
        """Positions the whole pool holds (what one sequence could get alone)."""
        return self.num_usable_blocks * self.block_size


def plan_kv_cache(shape: KVShape, *, block_size: int, requested_max_len: int, checkpoint_max_len: int,
                  kv_cache_memory: int, device: torch.device, gpu_memory_utilization: float, total_bytes: int,
                  used_bytes: int) -> KVPlan:
    """The pool and max model length for one decoder (pure: the caller measures total_bytes and used_bytes)."""
    pool, source = kv_budget(kv_cache_memory=kv_cache_memory, device=device,
                             gpu_memory_utilization=gpu_memory_utilization, total_bytes=total_bytes,
                             used_bytes=used_bytes)
    per_token, per_block = shape.bytes_per_token, shape.bytes_per_block(block_size)
    num_blocks = pool // per_block
    fits = max(0, num_blocks - NULL_BLOCKS) * block_size
    if fits == 0:
        raise KVPlanError(f"the K/V pool ({_size(pool)}, {source}) holds no block of {block_size} tokens "
                          f"({_size(per_block)} at {_per_token(per_token)}, plus the null block); "
                          f"{_advice(device)}")
    if requested_max_len > fits:
        raise KVPlanError(f"--max-model-len {requested_max_len} needs {_size(requested_max_len * per_token)} of K/V "
                          f"({_per_token(per_token)}) for one sequence, more than the K/V pool holds: "
                          f"{_size(pool)} ({pool} bytes: {source}), {fits} tokens; the largest --max-model-len that "
                          f"fits is {fits}. Lower --max-model-len or {_advice(device)}")
    max_len, warning = requested_max_len or min(checkpoint_max_len, fits), None
    if not requested_max_len and checkpoint_max_len > fits:
        warning = (f"max_model_len lowered from the checkpoint's {checkpoint_max_len} to {fits}: what one sequence "
                   f"can hold in the K/V pool ({_size(pool)}, {source}; {_per_token(per_token)})")
    return KVPlan(num_blocks, block_size, per_token, pool, max_len, source, warning)


def kv_budget(*, kv_cache_memory: int, device: torch.device, gpu_memory_utilization: float, total_bytes: int,
              used_bytes: int) -> tuple[int, str]:
    """(bytes for the K/V pool, where that number came from)."""
    free = total_bytes - used_bytes
    if kv_cache_memory:
        if kv_cache_memory > (free if device.type == "cuda" else total_bytes):
            where = f"{_size(free)} free on {device}" if device.type == "cuda" else f"{_size(total_bytes)} of RAM"
            raise KVPlanError(f"--kv-cache-memory {kv_cache_memory} ({_size(kv_cache_memory)}) is more than the "
                              f"{where}")
        return kv_cache_memory, f"--kv-cache-memory {kv_cache_memory}"
    if device.type == "cuda":
        pool = int(total_bytes * gpu_memory_utilization) - used_bytes
        return max(0, pool), (f"--gpu-memory-utilization {gpu_memory_utilization:g} of {_size(total_bytes)} "
                              f"on {device}, {_size(used_bytes)} used by weights, activations and others")
    pool = min(total_bytes // CPU_SHARE, int(total_bytes * CPU_HEADROOM) - used_bytes)
    return max(0, pool), f"1/{CPU_SHARE} of {_size(total_bytes)} RAM, at most {CPU_HEADROOM:g} of it less the weights"


def checkpoint_max_len(text: Any, requested_max_len: int = 0) -> int:
    """The positions a checkpoint is served to: its max_position_embeddings, or for longrope (Phi-3's and
    Phi-4-multimodal's rotary scaling) its original_max_position_embeddings. Past that longrope takes its long
    factors for a whole forward, chosen from the forward's largest position; transformers then drops its cache and
    prefills again, and a packed step would choose for every row at once (one long request would change its
    neighbours' answers), so EPD serves such a checkpoint within the short factors only, where it equals
    generate(). KVPlanError when `requested_max_len` is past that."""
    limit = int(text.max_position_embeddings)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "longrope":
        original = rope.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings",
                                                                            None)
        if original and int(original) < limit:
            limit = int(original)
            if requested_max_len > limit:
                raise KVPlanError(f"--max-model-len {requested_max_len} is past this checkpoint's longrope "
                                  f"original_max_position_embeddings {limit}: past it the rotary embedding switches "
                                  "to its long factors, which EPD does not serve yet (positions past them would "
                                  f"differ from transformers'); use --max-model-len {limit} or less")
    return limit


def plan_for(cfg: EngineSettings, lm: LanguageHalf, used_bytes: int | None = None) -> KVPlan:
    """The plan for a loaded LM under cfg. used_bytes: the caller's measure (CUDA: after a profiling forward);
    None measures now (CUDA: the weights only, an upper bound on the pool; CPU: the weights' bytes)."""
    shape = KVShape.of(lm.config.get_text_config(), lm.dtype, lm.tp_size)  # a rank's pool: its share of heads
    if lm.device.type == "cuda":
        total, used_now = cuda_budget(lm.device)
    else:
        total, used_now = cpu_total_bytes(), module_bytes(lm.module)
    return plan_kv_cache(shape, block_size=cfg.block_size, requested_max_len=cfg.max_model_len,
                         checkpoint_max_len=checkpoint_max_len(lm.config.get_text_config(), cfg.max_model_len),
                         kv_cache_memory=cfg.kv_cache_memory, device=lm.device,
                         gpu_memory_utilization=cfg.gpu_memory_utilization, total_bytes=total,
                         used_bytes=used_now if used_bytes is None else used_bytes)


def plan_engine(cfg: EngineSettings, lm: LanguageHalf) -> KVPlan:
    """The engine's plan. CUDA: measured after one profiling forward of a full step (--max-num-batched-tokens
    positions), so its activations count as used (vLLM's rule); CPU: from the weights' bytes."""
    used = None
    if lm.device.type == "cuda":
        profile_forward(lm, cfg.num_batched_tokens)
        used = cuda_budget(lm.device)[1]
    return plan_for(cfg, lm, used)


@torch.inference_mode()
def profile_forward(lm: LanguageHalf, num_tokens: int) -> None:
    """One forward of the largest step the engine takes (without K/V), to leave its peak in the allocator's
    reserve; the logits of every position count too (a step takes at most one per row, so this overestimates)."""
    hidden = lm.module.language_model.config.hidden_size
    embeds = torch.zeros(1, num_tokens, hidden, dtype=lm.dtype, device=lm.device)
    positions = torch.arange(num_tokens, device=lm.device).view(1, -1)
    config = lm.module.language_model.config
    paged, config._attn_implementation = config._attn_implementation, "sdpa"  # no pool yet (or another engine's)
    try:
        with local_forward():  # tensor parallelism: each rank profiles its own share, alone
            out = lm.module.language_model(inputs_embeds=embeds, position_ids=positions, use_cache=False)
        lm.module.lm_head(out.last_hidden_state[:, -1:])
    finally:
        config._attn_implementation = paged
    del out
    torch.cuda.synchronize(lm.device)


def cuda_budget(device: torch.device) -> tuple[int, int]:
    """(total, used) bytes of a GPU now; used counts every process and the caching allocator's reserve."""
    free, total = torch.cuda.mem_get_info(device)
    return total, total - free


def cpu_total_bytes() -> int:
    """Physical RAM, or the container's memory limit when lower."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = _CGROUP_LIMIT.read_text().strip()
    except OSError:
        return ram
    return min(ram, int(limit)) if limit.isdigit() else ram


def module_bytes(module: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of a module's parameters and buffers (a tied tensor once; meta ones too), at `dtype` when given (what
    loading will cast them to)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    size = None if dtype is None else torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (size or t.element_size()) for t in tensors.values())


def _size(n: int) -> str:
    if n < 2**10:
        return f"{n} B"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB"


def _per_token(n: int) -> str:
    return f"{n} bytes ({_size(n)}) per token" if n >= 2**10 else f"{n} bytes per token"


def _advice(device: torch.device) -> str:
    if device.type == "cuda":
        return "raise --gpu-memory-utilization or --kv-cache-memory, or use a larger GPU"
    return "raise --kv-cache-memory"
