"""Tiny InternVL checkpoints: 32 px tiles plus a thumbnail, an InternViT, pixel shuffle and a Qwen2 LM."""
from __future__ import annotations

from typing import Any

from transformers import InternVLConfig, PreTrainedTokenizerFast, Qwen2Config
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

from epd_builders.families.common import Built, text_sizes
from epd_builders.tokenizer import train_tokenizer
from epd_models.processors import InternVLImageProcessorOnly

TILE, PATCH = 32, 8
TOKENS_PER_TILE = (TILE // PATCH) ** 2 // 4  # pixel shuffle with downsample_ratio 0.5 halves both sides
# the tokenizer attributes InternVLProcessor reads (a real InternVL tokenizer has them in tokenizer_config.json)
NAMED_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"}


def with_named_tokens(tok: PreTrainedTokenizerFast, named: dict[str, str]) -> PreTrainedTokenizerFast:
    """`tok` with `named` added as special tokens readable as attributes (`tok.start_image_token(_id)`)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, bos_token=tok.bos_token, eos_token=tok.eos_token,
        pad_token=tok.pad_token, chat_template=tok.chat_template,
        extra_special_tokens={"image_token": tok.image_token, "video_token": tok.video_token, **named},
    )


def build(spec: Any) -> Built:
    tok: Any = with_named_tokens(train_tokenizer("<IMG_CONTEXT>", "<IMG_CONTEXT>"), NAMED_TOKENS)
    cfg = InternVLConfig(
        vision_config=InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=[TILE, TILE], patch_size=[PATCH, PATCH]),
        text_config=Qwen2Config(**text_sizes(spec, tok)),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=TOKENS_PER_TILE,
        downsample_ratio=0.5, tie_word_embeddings=False,
    )
    # up to 6 tiles: 224x224 gets 2x2 (+ thumbnail), 168x112 gets 3x2 (+ thumbnail)
    image_processor = GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, crop_to_patches=True,
                                               min_patches=1, max_patches=6)
    processor = InternVLImageProcessorOnly(image_processor=image_processor, tokenizer=tok,
                                           image_seq_length=TOKENS_PER_TILE, chat_template=tok.chat_template)
    return Built(cfg, processor, tok)
