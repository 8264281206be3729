"""Tiny LLaVA-1.5 checkpoints: a CLIP tower, an MLP projector and a Llama LM."""
from __future__ import annotations

from typing import Any

from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

from epd_builders.families.common import Built, special_ids
from epd_builders.tokenizer import train_tokenizer


def llava_config(tok: Any, vision: dict[str, Any], text: dict[str, Any]) -> LlavaConfig:
    """A LLaVA (CLIP tower + Llama LM) config; `vision` are CLIPVisionConfig sizes, `text` LlamaConfig sizes."""
    return LlavaConfig(
        vision_config=CLIPVisionConfig(**vision, projection_dim=vision["hidden_size"]),
        text_config=LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, **text, **special_ids(tok)),
        image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
    )


def llava_processor(tok: Any, image_size: int, patch: int) -> LlavaProcessor:
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=patch,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, chat_template=tok.chat_template,
    )


def build(spec: Any) -> Built:
    tok = train_tokenizer("<image>", "<image>")
    vision: dict[str, Any] = dict(hidden_size=spec.vision_hidden, intermediate_size=spec.vision_hidden * 2,
                  num_hidden_layers=spec.vision_layers, num_attention_heads=spec.heads,
                  image_size=spec.image_size, patch_size=spec.patch)
    text: dict[str, Any] = dict(hidden_size=spec.text_hidden, intermediate_size=spec.text_hidden * 2,
                num_hidden_layers=spec.text_layers, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, max_position_embeddings=4096)
    return Built(llava_config(tok, vision, text), llava_processor(tok, spec.image_size, spec.patch), tok)


