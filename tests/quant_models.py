"""Quantized tiny checkpoints and their dequantized twins (epd_builders/quantize.py), built once per session.

The LM is 128 wide so that each format's published group (128) and block (128 x 128) fit whole where they are asked
for; the tests use group 32, which divides every linear of the tiny families (their attention output is 64 wide)."""
from __future__ import annotations

from pathlib import Path

from epd_builders.quantize import build_quantized
from epd_builders.tiny import TinySpec, build_tiny

GROUP = 32


class QuantModels(dict[tuple[str, str], tuple[Path, Path]]):
    """(family, format) -> (quantized dir, twin dir), built on first use."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root
        self.sources: dict[str, Path] = {}

    def source(self, family: str) -> Path:
        if family not in self.sources:
            self.sources[family] = build_tiny(TinySpec(family=family, text_hidden=128, lm_scale=3.0),
                                              self.root / family)
        return self.sources[family]

    def __missing__(self, key: tuple[str, str]) -> tuple[Path, Path]:
        family, fmt = key
        out, twin = self.root / f"{family}-{fmt}", self.root / f"{family}-{fmt}-twin"
        build_quantized(self.source(family), fmt, out, twin, group_size=GROUP)
        self[key] = (out, twin)
        return self[key]
