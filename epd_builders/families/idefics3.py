"""Tiny Idefics3 checkpoints: the image resized to at most 96 px and split into 32 px tiles (row/column tokens) plus
a global view, a SigLIP-style tower, a pixel-shuffle connector and a Llama LM."""
from __future__ import annotations

from typing import Any

from transformers import Idefics3Config, Idefics3Processor, LlamaConfig
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

from epd_builders.families.common import Built, text_sizes
from epd_builders.tokenizer import train_tokenizer

TILE, PATCH, SCALE = 32, 8, 2
TOKENS_PER_TILE = (TILE // PATCH) ** 2 // SCALE**2
LONGEST_EDGE = 3 * TILE  # 224x224 -> 3x3 tiles, 168x112 -> 3x2 tiles (each + the global image)
# the processor writes <row_i_col_j> for up to 6x6 tiles and adds the other three itself (as a real vocab has them)
LAYOUT_TOKENS = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                 *(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6))]


def build(spec: Any) -> Built:
    tok: Any = train_tokenizer("<image>", "<image>")
    tok.add_special_tokens({"additional_special_tokens": LAYOUT_TOKENS}, replace_extra_special_tokens=False)
    cfg = Idefics3Config(
        vision_config=Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=TILE, patch_size=PATCH),
        text_config=LlamaConfig(**text_sizes(spec, tok)),
        image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=SCALE, tie_word_embeddings=False,
    )
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=TOKENS_PER_TILE,
                                  chat_template=tok.chat_template)
    return Built(cfg, processor, tok)
