"""Tiny LLaVA-OneVision checkpoints: any-resolution tiles of a SigLIP tower (anyres_max_9) and a Qwen2 LM.

A prompt with several images gets each image's base tile only (the processor and the model both look at how
many images the prompt has), so the encoder is told (`multi_image`) and it is part of the image's cache key."""
from __future__ import annotations

from typing import Any

import torch
from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

from epd_builders.families.common import Built, text_sizes
from epd_builders.tokenizer import train_tokenizer
from epd_models.processors import LlavaOnevisionImageProcessorOnly

TILE, PATCH = 32, 8  # 16 patches per tile ("full" strategy: all of them)
PINPOINTS = [[32, 64], [64, 32], [64, 64]]
SCALE = 0.1  # the projector's weights are scaled by this (see _calm_projector)


def build(spec: Any) -> Built:
    tok: Any = train_tokenizer("<image>", "<image>")
    cfg = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=TILE, patch_size=PATCH),
        text_config=Qwen2Config(**text_sizes(spec, tok)),
        image_token_index=tok.convert_tokens_to_ids("<image>"), video_token_index=tok.convert_tokens_to_ids("<|video_pad|>"),
        image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1, vision_feature_select_strategy="full",
        tie_word_embeddings=False,
    )
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE},
                                                      image_grid_pinpoints=PINPOINTS)
    processor = LlavaOnevisionImageProcessorOnly(image_processor=image_processor, tokenizer=tok,
                                                 num_image_tokens=(TILE // PATCH) ** 2,
                                                 vision_feature_select_strategy="full", chat_template=tok.chat_template)
    return Built(cfg, processor, tok, randomize=_calm_projector)


def _calm_projector(model: Any) -> None:
    """Random SigLIP features through a random projector swamp a tiny LM (it then repeats one token whatever the
    prompt); smaller projector weights keep the image's influence without that."""
    with torch.no_grad():
        for p in model.model.multi_modal_projector.parameters():
            p.mul_(SCALE)
