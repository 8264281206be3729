"""Builders for tiny random audio-capable models, saved in Hugging Face format with tokenizer, processor (feature
extractor) and chat template, as epd_builders/tiny.py does for the image families. The adapters serve these
families; they are kept out of tiny.py's BUILDERS, which the image-family tests run over.

    python -m epd_builders.audio_tiny --family qwen2_audio --out /tmp/tiny-qwen2-audio
"""
from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from epd_builders.families.common import Built

hf_logging.disable_progress_bar()
# family -> its builder module under epd_builders/families (each has build, MODEL_CLASS, audio_tokens,
# WINDOW_SECONDS and LM_PREFIXES)
AUDIO_BUILDERS = {"qwen2_audio": "qwen2_audio", "qwen2_5_omni": "qwen2_5_omni", "phi4_multimodal": "phi4_multimodal"}
AUDIO_FAMILIES = tuple(AUDIO_BUILDERS)
SAMPLING_RATE = 16000


@dataclass(frozen=True)
class AudioTinySpec:
    family: str = "qwen2_audio"
    text_hidden: int = 64
    text_layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vision_hidden: int = 64  # families with images (Qwen2.5-Omni; Phi-4's unused tower)
    vision_layers: int = 2
    image_size: int = 224  # Qwen2.5-Omni: longest edge of the pixel budget
    audio_hidden: int = 32
    audio_layers: int = 2
    audio_heads: int = 2
    lm_scale: float = 1.0  # >1 makes a random LM's greedy output less degenerate
    seed: int = 0
    shipped_loras: bool = False  # Phi-4-multimodal: write speech-lora/ and vision-lora/ beside the weights, as it ships

    def __post_init__(self) -> None:
        assert self.family in AUDIO_FAMILIES, f"unknown family {self.family!r}; one of {AUDIO_FAMILIES}"


def family_module(family: str) -> ModuleType:
    return importlib.import_module(f"epd_builders.families.{AUDIO_BUILDERS[family]}")


def model_class(family: str) -> Any:
    """The transformers class of the family's whole model (what `generate` runs on)."""
    return family_module(family).MODEL_CLASS


def build_audio_tiny(spec: AudioTinySpec, out_dir: str | Path) -> Path:
    """Build a random model for spec, save model + tokenizer + processor to out_dir, return it."""
    out = Path(out_dir)
    torch.manual_seed(spec.seed)
    module = family_module(spec.family)
    built: Built = module.build(spec)
    model = module.MODEL_CLASS(built.config).eval()
    if spec.lm_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith(module.LM_PREFIXES) and p.dim() > 1:
                    p.mul_(spec.lm_scale)
    gc, tok = model.generation_config, built.tokenizer
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(out)
    built.processor.save_pretrained(out)
    built.tokenizer.save_pretrained(out)
    if spec.shipped_loras:
        module.write_shipped_loras(model, out)
    return out


def audio_tokens(family: str, num_samples: int, processor: Any) -> int:
    """The audio placeholder tokens the family's processor writes for one clip of `num_samples` at 16 kHz: what the
    proxy and decoder size a prompt by before any encoder has run."""
    return int(family_module(family).audio_tokens(num_samples, processor))


def window_seconds(family: str) -> int:
    """The family's encoder window: Qwen2-Audio's one 30 s window (clips cut there), Qwen2.5-Omni's 2 s attention
    windows (encoded independently), Phi-4's 40 s attention windows (after a conv front end over the whole clip)."""
    return int(family_module(family).WINDOW_SECONDS)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m epd_builders.audio_tiny", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=AUDIO_FAMILIES, required=True)
    p.add_argument("--out", required=True, help="directory to write the checkpoint to")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(build_audio_tiny(AudioTinySpec(family=args.family, lm_scale=3.0, seed=args.seed), args.out))


if __name__ == "__main__":
    main()
