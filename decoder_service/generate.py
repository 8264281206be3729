"""Prefill + decode of one sequence with a KV cache; yields token ids as they are chosen."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache

from decoder_service.prompt import Prompt
from epd_models.halves import LanguageHalf


@torch.inference_mode()
def generate(
    lm: LanguageHalf, prompt: Prompt, choose: Callable[[torch.Tensor], int], max_tokens: int, eos_ids: set[int]
) -> Iterator[int]:
    """Yield up to max_tokens ids; stops after an EOS id. The caller may stop iterating at any time."""
    cache = DynamicCache(config=lm.config.get_text_config())
    # prefill
    embeds = lm.embed(prompt.input_ids, prompt.images)
    positions, rope_delta = lm.position_ids(prompt.input_ids, prompt.images)
    logits = lm.forward(embeds, positions, cache)
    past_len = prompt.num_tokens
    # decode
    for i in range(max_tokens):
        token = choose(logits)
        yield token
        if token in eos_ids or i == max_tokens - 1:
            return
        embeds = lm.embed(torch.tensor([[token]]), [])
        logits = lm.forward(embeds, lm.to_device(lm.adapter.decode_position_ids(past_len, rope_delta)), cache)
        past_len += 1


def eos_token_ids(lm: LanguageHalf) -> set[int]:
    """EOS ids from the generation config, else the tokenizer's."""
    eos = lm.generation_config.eos_token_id
    if eos is None:
        eos = lm.tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
