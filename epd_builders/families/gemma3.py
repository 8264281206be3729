"""Tiny Gemma 3 checkpoints: a SigLIP tower, an avg-pool + RMSNorm projector, a Gemma 3 LM with sliding layers.

Two traps a random tiny Gemma 3 would hide, made visible here:
- the projector's `mm_input_projection_weight` is zero after init (every image would embed to zeros): randomised;
- the processor writes "\\n\\n" around each image's span: the tokenizer merges newline runs, as Gemma's does, so a
  decoder that tokenized those edges apart from their neighbours would get other ids than the processor.
"""
from __future__ import annotations

import json
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import Gemma3Config, Gemma3Processor, Gemma3TextConfig, PreTrainedTokenizerFast, SiglipVisionConfig
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from epd_builders.families.common import Built, special_ids
from epd_builders.tokenizer import train_tokenizer

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
IMAGE, PATCH, TOKENS = 32, 4, 16  # 8x8 patches avg-pooled to 4x4 = 16 soft tokens per image
SLIDING_WINDOW = 8  # shorter than every parity prompt, so the sliding layers' mask is exercised
NEWLINE_RUNS = ("ĊĊ", "ĊĊĊ", "ĊĊĊĊ")  # byte-level "\n\n", "\n\n\n", "\n\n\n\n": one token each, as in Gemma


def build(spec: Any) -> Built:
    tok = gemma_tokenizer()
    head_dim = spec.text_hidden // spec.heads
    text = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=spec.text_hidden, intermediate_size=spec.text_hidden * 2,
        num_hidden_layers=2, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=head_dim,
        query_pre_attn_scalar=head_dim, sliding_window=SLIDING_WINDOW, max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"], **special_ids(tok),
    )
    vision = SiglipVisionConfig(hidden_size=spec.vision_hidden, intermediate_size=spec.vision_hidden * 2,
                                num_hidden_layers=spec.vision_layers, num_attention_heads=spec.heads,
                                image_size=IMAGE, patch_size=PATCH)
    boi, eoi, soft = (tok.added_tokens_encoder[t] for t in (BOI, EOI, SOFT))
    cfg = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=TOKENS,
                       boi_token_index=boi, eoi_token_index=eoi, image_token_index=soft)
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=TOKENS,
                                chat_template=tok.chat_template)
    return Built(cfg, processor, tok, randomize=_randomize_projector)


def gemma_tokenizer() -> PreTrainedTokenizerFast:
    """The project's BPE with merged newline runs, Gemma 3's image tokens, and a template writing <start_of_image>."""
    base = train_tokenizer(SOFT, BOI)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_with_newline_runs(base.backend_tokenizer), bos_token=base.bos_token,
        eos_token=base.eos_token, pad_token=base.pad_token, chat_template=base.chat_template,
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT, "video_token": "<|video_pad|>"},
    )
    tok.add_special_tokens({"additional_special_tokens": [BOI, EOI, SOFT]}, replace_extra_special_tokens=False)
    return tok


def _with_newline_runs(backend: Tokenizer) -> Tokenizer:
    """`backend` with merges that make each run of 2-4 newlines one token (the trained corpus has none)."""
    data = json.loads(backend.to_str())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    for run in NEWLINE_RUNS:
        vocab[run] = len(vocab)
        merges.append([run[:-1], run[-1]])
    return Tokenizer.from_str(json.dumps(data))


def _randomize_projector(model: Any) -> None:
    """transformers zero-initialises the projection: without this every image embeds to the same zero rows."""
    with torch.no_grad():  # std 0.5 drowns the text (greedy repeats one token); 0.1 keeps both in play
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.1)
