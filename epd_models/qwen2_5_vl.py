"""Qwen2.5-VL family: Qwen2-VL's layout and M-RoPE with a windowed-attention vision tower."""
from __future__ import annotations

from typing import Any

from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLTextModel,
)

from epd_models.qwen2_vl import Qwen2VLAdapter


class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    vision_cls: Any = Qwen2_5_VisionTransformerPretrainedModel
    text_cls: Any = Qwen2_5_VLTextModel
