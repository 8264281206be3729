"""What the engine is given to run: a prompt with its media features, the request prepared around it (`Work`), and,
on a decode worker, the prefill worker's hand-off it continues (`Resume`). The service shell builds them
(decoder_service/request.py, decoder_service/handoff.py); the engine only reads them."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from epd_contracts.embeddings import ImageFeatures
from epd_contracts.generate import Handoff
from epd_contracts.sampling import SamplingParams

if TYPE_CHECKING:
    from decoder_service.engine.interfaces import CompiledGrammar
    from decoder_service.engine.prefix_hash import PrefixChain
    from epd_models.tool_parsers import ToolFormat


@dataclass(frozen=True)
class Prompt:
    input_ids: torch.Tensor  # (1, L) int64, placeholders expanded
    images: list[ImageFeatures]  # images and videos, in prompt order
    lora: int = 0  # the LoRA adapter's slot (epd_models/lora/layers.py `LoRASet`); 0: the base model

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])


@dataclass(frozen=True)
class Resume:
    """A request to continue: its hand-off, and the checked blocks of its prompt (None: prefill it here, `why`)."""

    handoff: Handoff
    kv: torch.Tensor | None = None  # (blocks from first_block on, *KVLayout.block_shape) on the host
    why: str = ""
    first_block: int = 0  # the blocks before it were held here already, under the same prefix keys: not fetched

    @property
    def rows(self) -> int:
        """Choices that continue here (the others ended at their first token on the prefill worker)."""
        return sum(c.first_token is not None for c in self.handoff.choices)


@dataclass(frozen=True)
class Work:
    """One request, ready to run: n choices of `params` from one prefill of `prompt`."""

    prompt: Prompt
    params: SamplingParams  # max_tokens resolved
    guide: CompiledGrammar | None = None  # each choice makes its own matcher at admission
    tools: ToolFormat | None = None  # each choice parses its output with its own parser
    echo: str = ""  # completions with echo: the prompt's text, each choice's first delta
    held_image_positions: tuple[int, ...] = ()  # sorted prompt positions of the held image (video) rows' tokens
    chain: PrefixChain | None = None  # the prompt's prefix-cache keys (None: the cache is off, or not cacheable)
    route_keys: tuple[str, ...] = ()  # the proxy's prefix keys (routing hints, reported in /health)
    handoff_key: str | None = None  # prefill worker: hand the request off under this key after its first tokens
    resume: Resume | None = None  # decode worker: continue what a prefill worker began (decoder_service/handoff.py)
    client: str = ""  # whose request, for fair admission (decoder_service/engine/fairness.py): its cache_salt

    @property
    def cached_tokens(self) -> int:
        """Tokens of images (and video chunks) whose embeddings were already held (no vision work for this
        request)."""
        return len(self.held_image_positions)

    def held_image_tokens_from(self, position: int) -> int:
        """Tokens of held images at `position` or later (those before it came from the prefix cache)."""
        return len(self.held_image_positions) - bisect.bisect_left(self.held_image_positions, position)
