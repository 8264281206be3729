"""Chat messages -> token ids with each image placeholder expanded to its embedding's length."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.base import ImageFeatures, expand_placeholders
from models.halves import LanguageHalf


@dataclass(frozen=True)
class Prompt:
    input_ids: torch.Tensor  # (1, L) int64, placeholders expanded
    images: list[ImageFeatures]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])


def chat_template(lm: LanguageHalf) -> str:
    """The tokenizer's template, else the processor's (LLaVA checkpoints keep it there)."""
    if lm.tokenizer.chat_template:
        return str(lm.tokenizer.chat_template)
    for name in ("chat_template.jinja", "chat_template.json"):
        path = Path(lm.model_dir) / name
        if path.exists():
            text = path.read_text()
            return str(json.loads(text)["chat_template"]) if name.endswith(".json") else text
    raise ValueError(f"model at {lm.model_dir} has no chat template")


def render(lm: LanguageHalf, messages: list[dict[str, Any]], template: str) -> list[int]:
    """Apply the chat template (one placeholder per image) and tokenize."""
    text = lm.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    # NOTE: like apply_chat_template(tokenize=True): the template owns BOS and other specials
    return list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


def build_prompt(lm: LanguageHalf, ids: list[int], images: list[ImageFeatures]) -> Prompt:
    expanded = expand_placeholders(ids, lm.image_token_id, [im.num_tokens for im in images])
    return Prompt(input_ids=torch.tensor([expanded], dtype=torch.long), images=images)
