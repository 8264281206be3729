"""Tiny LoRA adapters for the test families, made by PEFT itself (its `save_pretrained` writes the format EPD reads),
with random A and B (PEFT's default B is zero, which would test nothing), and transformers' reference: the
PEFT-merged model."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText

TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"


def make_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8, targets: str = TARGETS,
                 alpha: int = 16) -> Path:
    """A PEFT LoRA adapter of `rank` on the LM's attention and MLP linears, weights drawn from `seed`."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                      init_lora_weights=False))
    with torch.no_grad():  # large enough to change greedy answers of a random model
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(out)
    return out


def merged_model(model_dir: Path, adapter: Path) -> torch.nn.Module:
    """transformers' model with the adapter merged into its weights (PEFT's merge_and_unload)."""
    from peft import PeftModel

    base = AutoModelForImageTextToText.from_pretrained(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
