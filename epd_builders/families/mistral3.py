"""Tiny Mistral 3 checkpoints: a Pixtral tower at the image's own resolution (up to 64 px), a 2x2 patch merger and
a Mistral LM; the prompt holds rows of [IMG] ended by [IMG_BREAK], the last by [IMG_END]."""
from __future__ import annotations

from typing import Any

import torch
from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

from epd_builders.families.common import Built, text_sizes
from epd_builders.tokenizer import train_tokenizer
from epd_models.pixtral_processor import PixtralProcessorPil

LONGEST_EDGE, PATCH, MERGE = 64, 8, 2  # one [IMG] per 16x16 px: 224x224 -> 4 rows of 4, 168x112 -> 3 rows of 4


def build(spec: Any) -> Built:
    tok: Any = train_tokenizer("[IMG]", "[IMG]")
    tok.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]},
                           replace_extra_special_tokens=False)
    head_dim = spec.text_hidden // spec.heads
    cfg = Mistral3Config(
        vision_config=PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, image_size=LONGEST_EDGE, patch_size=PATCH),
        text_config=MistralConfig(**text_sizes(spec, tok), head_dim=head_dim, sliding_window=None),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=MERGE, vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    image_processor = PixtralImageProcessorPil(size={"longest_edge": LONGEST_EDGE},
                                               patch_size={"height": PATCH, "width": PATCH})
    processor = PixtralProcessorPil(image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
                                    spatial_merge_size=MERGE, chat_template=tok.chat_template)
    return Built(cfg, processor, tok, randomize=lambda model: _scale_projector(model, spec.lm_scale))


def _scale_projector(model: Any, scale: float) -> None:
    """The projector writes into the LM's embedding space: scaled as the LM is (`lm_scale`), else the image rows are
    small next to the text's and a red circle makes this random LM repeat one token (seed 0)."""
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.mul_(scale)
