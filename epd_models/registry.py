"""Pick the family adapter for a checkpoint's config."""
from __future__ import annotations

from transformers import PretrainedConfig

from epd_models.base import FamilyAdapter
from epd_models.llava import LlavaAdapter
from epd_models.qwen2_5_vl import Qwen2_5_VLAdapter
from epd_models.qwen2_vl import Qwen2VLAdapter

ADAPTERS: tuple[FamilyAdapter, ...] = (LlavaAdapter(), Qwen2VLAdapter(), Qwen2_5_VLAdapter())


def adapter_for(cfg: PretrainedConfig) -> FamilyAdapter:
    for adapter in ADAPTERS:
        if cfg.model_type in adapter.model_types:
            return adapter
    supported = sorted(t for a in ADAPTERS for t in a.model_types)
    raise ValueError(f"unsupported model_type {cfg.model_type!r}; supported: {supported}")
