"""The family adapter interface: one object per model family serves both halves."""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from epd_contracts.embeddings import ImageFeatures

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PretrainedConfig


class LanguageModules(nn.Module):
    """The decoder's modules, named as the normalized checkpoint keys: language_model.*, lm_head.*."""

    def __init__(self, language_model: Any, hidden_size: int, vocab_size: int):
        super().__init__()
        self.language_model: Any = language_model  # the family's base text model (embed_tokens, layers, norm)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)


class FamilyAdapter(ABC):
    """What a family knows: its checkpoint keys, its vision half, and its LM-side merge and positions."""

    name: str
    model_types: tuple[str, ...]
    # (pattern, replacement) applied in order to on-disk keys -> our module names
    key_renames: tuple[tuple[str, str], ...]
    vision_prefixes: tuple[str, ...]  # normalized key prefixes that belong to the encoder half

    def normalize_key(self, key: str) -> str:
        for pattern, repl in self.key_renames:
            new, n = re.subn(pattern, repl, key, count=1)
            if n:
                return new
        return key

    def is_vision_key(self, key: str) -> bool:
        return self.normalize_key(key).startswith(self.vision_prefixes)

    # encoder half
    @abstractmethod
    def build_vision(self, cfg: PretrainedConfig) -> nn.Module: ...

    @abstractmethod
    def preprocess(self, image_processor: Any, images: list[Image.Image], detail: str = "auto") -> dict[str, torch.Tensor]:
        """The vision tower's inputs. `detail` is image_url.detail: a family with a resolution knob encodes "low" at
        its processor's minimum resolution (Qwen-style dynamic resolution); the others have a fixed input size and
        ignore it (documented in the README's compatibility table)."""

    @abstractmethod
    def encode(self, vision: nn.Module, cfg: PretrainedConfig, inputs: dict[str, torch.Tensor]) -> list[ImageFeatures]: ...

    @abstractmethod
    def num_image_tokens(self, image_processor: Any, cfg: PretrainedConfig, width: int, height: int) -> int: ...

    # decoder half
    @abstractmethod
    def build_language(self, cfg: PretrainedConfig) -> LanguageModules: ...

    def image_token_id(self, cfg: PretrainedConfig) -> int:
        return int(cfg.image_token_id)

    def position_ids(
        self, cfg: PretrainedConfig, input_ids: torch.Tensor, images: list[ImageFeatures]
    ) -> tuple[torch.Tensor, int]:
        """Prefill positions for a (1, L) prompt and the delta that decode positions add."""
        return torch.arange(input_ids.shape[-1]).view(1, -1), 0

    def decode_position_ids(self, past_len: int, rope_delta: int) -> torch.Tensor:
        return torch.tensor([[past_len + rope_delta]])


def expand_placeholders(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Replace the i-th single image placeholder with counts[i] copies."""
    num_found = ids.count(image_token_id)
    if num_found != len(counts):
        raise ValueError(f"prompt has {num_found} image placeholders but {len(counts)} images were given")
    out: list[int] = []
    it = iter(counts)
    for tok in ids:
        out.extend([tok] * next(it) if tok == image_token_id else [tok])
    return out


def merge_image_embeds(
    inputs_embeds: torch.Tensor, input_ids: torch.Tensor, image_token_id: int, images: list[ImageFeatures]
) -> torch.Tensor:
    """Scatter image embeddings into the placeholder rows of inputs_embeds (1, L, H).

    input_ids and the features may be host tensors (the features come from the connector in CPU memory):
    the check runs where the ids are, and the mask and features move to inputs_embeds' device in one copy each.
    """
    if not images:
        return inputs_embeds
    is_image = input_ids == image_token_id
    feats = torch.cat([im.embeds for im in images])
    assert int(is_image.sum()) == feats.shape[0], "placeholder count != image tokens"
    mask = is_image.to(inputs_embeds.device, non_blocking=True).unsqueeze(-1).expand_as(inputs_embeds)
    feats = feats.to(inputs_embeds.device, inputs_embeds.dtype, non_blocking=True)
    return inputs_embeds.masked_scatter(mask, feats)
