"""One sequence, prefilled and decoded on the engine's own path (a one-slot ModelRunner); yields token ids."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from decoder_service.engine.eos import eos_token_ids  # noqa: F401 - the reference loop's callers take it from here too
from decoder_service.engine.model_runner import ModelRunner
from decoder_service.prompt import Prompt
from epd_models.halves import LanguageHalf


@torch.inference_mode()
def generate(
    lm: LanguageHalf, prompt: Prompt, choose: Callable[[torch.Tensor], int], max_tokens: int, eos_ids: set[int],
    chunk: int | None = None,
) -> Iterator[int]:
    """Yield up to max_tokens ids; stops after an EOS id. The caller may stop iterating at any time.

    `chunk`: prefill in chunks of at most this many tokens (default: the whole prompt at once)."""
    runner = ModelRunner(lm, max_slots=1, max_len=prompt.num_tokens + max_tokens + 1,
                         chunk=chunk or prompt.num_tokens)
    runner.add(0, prompt)
    done: dict[object, torch.Tensor] = {}
    while not done:
        done = runner.prefill(prompt.num_tokens)
    logits = done[0]
    for i in range(max_tokens):
        token = choose(logits)
        yield token
        if token in eos_ids or i == max_tokens - 1:
            return
        logits = runner.decode({0: token})[0]
