"""The two halves of a VLM, each loaded from the same checkpoint without the other's weights."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from models.base import FamilyAdapter, ImageFeatures, merge_image_embeds
from models.registry import adapter_for
from models.weights import load_filtered

if TYPE_CHECKING:
    from PIL import Image
    from transformers import Cache

hf_logging.disable_progress_bar()


def _dtype(cfg: object, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    found = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found)
    return found if isinstance(found, torch.dtype) else torch.float32


class VisionHalf:
    """Vision tower + projector only; the LM tensors are never read from disk."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype | None = None):
        self.model_dir = Path(model_dir)
        self.config = AutoConfig.from_pretrained(self.model_dir)
        self.adapter = adapter_for(self.config)
        self.module = self.adapter.build_vision(self.config).to(_dtype(self.config, dtype)).eval()
        missing = load_half(self.module, self.model_dir, self.adapter, vision=True)
        if missing:
            raise ValueError(f"checkpoint {self.model_dir} lacks vision weights: {missing[:5]}")
        self.image_processor = AutoImageProcessor.from_pretrained(self.model_dir)

    @torch.inference_mode()
    def encode(self, images: list[Image.Image]) -> list[ImageFeatures]:
        if not images:
            return []
        inputs = self.adapter.preprocess(self.image_processor, images)
        return self.adapter.encode(self.module, self.config, inputs)

    def num_image_tokens(self, width: int, height: int) -> int:
        return self.adapter.num_image_tokens(self.image_processor, self.config, width, height)


class LanguageHalf:
    """The LM (embeddings, decoder layers, lm_head) only; vision tensors are never read from disk."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype | None = None):
        self.model_dir = Path(model_dir)
        self.config = AutoConfig.from_pretrained(self.model_dir)
        self.adapter = adapter_for(self.config)
        self.module = self.adapter.build_language(self.config)
        self.module.to(_dtype(self.config, dtype)).eval()
        missing = load_half(self.module, self.model_dir, self.adapter, vision=False)
        if missing == ["lm_head.weight"] and self.config.get_text_config().tie_word_embeddings:
            self.module.lm_head.weight = self.module.language_model.embed_tokens.weight
            missing = []
        if missing:
            raise ValueError(f"checkpoint {self.model_dir} lacks LM weights: {missing[:5]}")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.generation_config = _generation_config(self.model_dir)
        self.image_token_id = self.adapter.image_token_id(self.config)

    def embed(self, input_ids: torch.Tensor, images: list[ImageFeatures]) -> torch.Tensor:
        embeds = self.module.language_model.embed_tokens(input_ids)
        return merge_image_embeds(embeds, input_ids, self.image_token_id, images)

    def position_ids(self, input_ids: torch.Tensor, images: list[ImageFeatures]) -> tuple[torch.Tensor, int]:
        return self.adapter.position_ids(self.config, input_ids, images)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
        """Run the LM over new positions; return the last position's logits (vocab,)."""
        out = self.module.language_model(
            inputs_embeds=inputs_embeds, position_ids=position_ids, cache=cache, use_cache=True
        )
        return self.module.lm_head(out.last_hidden_state[0, -1]).float()

    def forward_rows(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: Cache,
                     attention_mask: torch.Tensor) -> torch.Tensor:
        """Run a batch of rows over new positions with an explicit 4D mask; return each row's last logits."""
        out = self.module.language_model(inputs_embeds=inputs_embeds, position_ids=position_ids, cache=cache,
                                         attention_mask=attention_mask, use_cache=True)
        return self.module.lm_head(out.last_hidden_state[:, -1]).float()


def loaded_summary(module: torch.nn.Module) -> dict[str, object]:
    """What a process really holds: its top-level modules and parameter count (for /health)."""
    return {"modules": sorted(name for name, _ in module.named_children()),
            "num_parameters": sum(p.numel() for p in module.parameters())}


def load_half(module: torch.nn.Module, model_dir: Path, adapter: FamilyAdapter, vision: bool) -> list[str]:
    """Load one half's tensors; returns the module keys the checkpoint did not supply."""
    prefixes = adapter.vision_prefixes
    return load_filtered(
        module, model_dir, rename=adapter.normalize_key, keep=lambda name: name.startswith(prefixes) == vision
    )


def _generation_config(model_dir: Path) -> GenerationConfig:
    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:  # checkpoint without generation_config.json
        return GenerationConfig()
