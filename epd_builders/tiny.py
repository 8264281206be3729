"""Builders for tiny random VLMs of each family, saved in Hugging Face format with tokenizer and processor.

    python -m epd_builders.tiny --family gemma3 --out /tmp/tiny-gemma3   # then: disagg-epd-proxy --model /tmp/...
"""
from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText
from transformers.utils import logging as hf_logging

from epd_builders.families.common import Built

hf_logging.disable_progress_bar()
# family -> its builder module under epd_builders/families
BUILDERS = {
    "llava": "llava", "qwen2_vl": "qwen", "qwen2_5_vl": "qwen", "qwen3_vl": "qwen3_vl", "llava_next": "llava_next",
    "gemma3": "gemma3", "internvl": "internvl", "mistral3": "mistral3", "idefics3": "idefics3",
    "llava_onevision": "llava_onevision", "qwen3_vl_moe": "qwen3_vl_moe",
}
FAMILIES = tuple(BUILDERS)


@dataclass(frozen=True)
class TinySpec:
    family: str = "llava"
    text_hidden: int = 64
    text_layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vision_hidden: int = 64
    vision_layers: int = 2
    image_size: int = 224  # LLaVA: square input; Qwen: longest edge of the pixel budget; tiled families: a tile
    patch: int = 14
    lm_scale: float = 1.0  # >1 makes a random LM's greedy output less degenerate
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.family in FAMILIES, f"unknown family {self.family!r}; one of {FAMILIES}"


def build_tiny(spec: TinySpec, out_dir: str | Path) -> Path:
    """Build a random model for spec, save model + tokenizer + processor to out_dir, return it."""
    out = Path(out_dir)
    torch.manual_seed(spec.seed)
    built: Built = importlib.import_module(f"epd_builders.families.{BUILDERS[spec.family]}").build(spec)
    model = AutoModelForImageTextToText.from_config(built.config).eval()
    if built.randomize is not None:
        built.randomize(model)
    if spec.lm_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ("language_model" in name or "text_model" in name) and p.dim() > 1:
                    p.mul_(spec.lm_scale)
    _set_generation_ids(model, built.tokenizer)
    model.save_pretrained(out)
    built.processor.save_pretrained(out)
    built.tokenizer.save_pretrained(out)
    return out


def _set_generation_ids(model: Any, tok: Any) -> None:
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m epd_builders.tiny", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--out", required=True, help="directory to write the checkpoint to")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(build_tiny(TinySpec(family=args.family, lm_scale=3.0, seed=args.seed), args.out))


if __name__ == "__main__":
    main()
