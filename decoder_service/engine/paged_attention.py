"""The attention over the paged pool, registered with transformers as the attention implementation "epd_paged":
the packed forward's queries split back into their segment groups (decoder_service/engine/step_plan.py), each
attending over its rows' blocks; on CUDA through varlen (decoder_service/engine/cuda_attention.py), on the CPU
decode rows through the in-place kernel (decoder_service/engine/cpu_attention.py) where the family's mask is the plain
causal one and the kernel is loaded, and otherwise by SDPA over the blocks gathered into the pool's workspace
(decoder_service/engine/kv_cache.py)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from decoder_service.engine.cuda_attention import varlen_paged_attention
from decoder_service.engine.kv_cache import PagedCache
from decoder_service.engine.step_plan import Mask, cache_in_flight, plan_in_flight

ATTENTION = "epd_paged"


def _mask_for(module: Any, mask: Mask) -> torch.Tensor:
    if isinstance(mask, torch.Tensor):
        return mask
    layer_types = getattr(module.config, "layer_types", None)
    kind = layer_types[module.layer_idx] if layer_types else "full_attention"
    return mask[kind]


def _scale(query: torch.Tensor, scaling: float | None) -> float:
    return float(scaling) if scaling is not None else query.shape[-1] ** -0.5


def paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the packed forward: (1, heads, tokens, dim) -> (1, tokens, heads, dim)."""
    plan = plan_in_flight()
    if key.device.type == "cuda":
        return varlen_paged_attention(module, query, key, value, plan, scaling, kwargs.get("sliding_window")), None
    cache: PagedCache = cache_in_flight()
    gqa = query.shape[1] != cache.shape.kv_heads
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # (tokens, heads, dim)
    for g in plan.groups:
        if g.lens_tensor is not None and cache.decode_kernel is not None:  # decode rows, read in place
            cache.decode_kernel.paged_decode(query[0, :, g.first : g.first + g.num_q].transpose(0, 1), key, value,
                                             g.table, g.lens_tensor, _scale(query, scaling),
                                             out[g.first : g.first + g.num_q])
            continue
        q = query[0, :, g.first : g.first + g.num_q]  # (heads, num_q, dim)
        q = q.transpose(0, 1).unsqueeze(2) if g.decode else q.unsqueeze(0)  # (rows, heads, new, dim)
        k = cache.gather(key, g.table, g.kv_len, 0)
        v = cache.gather(value, g.table, g.kv_len, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask_for(module, g.mask), scale=scaling,
                                           enable_gqa=gqa)
        out[g.first : g.first + g.num_q] = o.squeeze(2) if g.decode else o[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION, paged_attention)
