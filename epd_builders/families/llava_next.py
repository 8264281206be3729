"""Tiny LLaVA-NeXT checkpoints: any-resolution tiles of a CLIP tower, unpadded, with a newline row per line."""
from __future__ import annotations

from typing import Any

from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextProcessor
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

from epd_builders.families.common import Built, text_sizes
from epd_builders.tokenizer import train_tokenizer

TILE, PATCH = 32, 8  # 16 patches per tile (the CLS token is dropped by the "default" strategy)
# (height, width) canvases: a 224x224 image gets 2x2 tiles, 168x112 the same canvas but fewer rows after unpadding
PINPOINTS = [[32, 64], [64, 32], [64, 64]]


def build(spec: Any) -> Built:
    tok: Any = train_tokenizer("<image>", "<image>")
    cfg = LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=TILE, patch_size=PATCH, projection_dim=32),
        text_config=LlamaConfig(**text_sizes(spec, tok)),
        image_token_index=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False,
    )
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
                                                 image_grid_pinpoints=PINPOINTS)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=tok.chat_template)
    return Built(cfg, processor, tok)
