"""A checkpoint's chat template, and chat messages -> token ids (one placeholder per image)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def chat_template(tokenizer: Any, model_dir: str | Path) -> str:
    """The tokenizer's template, else the processor's (LLaVA checkpoints keep it there)."""
    if tokenizer.chat_template:
        return str(tokenizer.chat_template)
    for name in ("chat_template.jinja", "chat_template.json"):
        path = Path(model_dir) / name
        if path.exists():
            text = path.read_text()
            return str(json.loads(text)["chat_template"]) if name.endswith(".json") else text
    raise ValueError(f"model at {model_dir} has no chat template")


class PromptTooLong(Exception):
    """The prompt cannot fit `max_tokens`; raised before it is tokenized in full. Not a ValueError on purpose:
    callers answer it with context_length_exceeded, not with "cannot build the prompt"."""

    def __init__(self, num_tokens_at_least: int, max_tokens: int) -> None:
        self.num_tokens_at_least, self.max_tokens = num_tokens_at_least, max_tokens
        super().__init__(f"the prompt has at least {num_tokens_at_least} tokens; at most {max_tokens} fit")


def render(tokenizer: Any, messages: list[dict[str, Any]], template: str, max_tokens: int | None = None) -> list[int]:
    """Apply the chat template (one placeholder per image) and tokenize.

    With `max_tokens`, a prompt that cannot fit raises PromptTooLong before it is tokenized in full.
    """
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    # NOTE: like apply_chat_template(tokenize=True): the template owns BOS and other specials
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
