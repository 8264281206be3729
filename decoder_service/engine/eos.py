"""Which token ids end a sequence."""
from __future__ import annotations

from epd_models.halves import LanguageHalf


def eos_token_ids(lm: LanguageHalf) -> set[int]:
    """EOS ids from the generation config, else the tokenizer's."""
    eos = lm.generation_config.eos_token_id
    if eos is None:
        eos = lm.tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
