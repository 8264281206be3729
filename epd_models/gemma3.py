"""Gemma 3: image tokens attend to each other both ways within one image (prefill), sliding-window layers.
TODO(helper): masks, chunk ends, text edges."""
from __future__ import annotations

from epd_models.base import FamilyAdapter


class Gemma3Adapter(FamilyAdapter):
    pass
