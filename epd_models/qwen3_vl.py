"""Qwen3-VL: Qwen's M-RoPE plus DeepStack (features of several vision layers added to the first LM layers'
hidden states at the image positions, in prefill). TODO(helper): DeepStack prefill state and kwargs."""
from __future__ import annotations

from epd_models.mrope import MRopeAdapter


class Qwen3VLAdapter(MRopeAdapter):
    pass
