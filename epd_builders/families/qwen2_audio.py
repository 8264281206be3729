"""Tiny Qwen2-Audio checkpoints: a Whisper-style audio tower (conv, transformer, 2x pooling) and a linear projector
in front of a Qwen2 LM.

The tower takes exactly one 30 s window (max_source_positions * 2 = 3000 mel frames, as the real 7B): the processor
pads every clip to it and cuts longer clips there (WhisperFeatureExtractor's truncation), so a clip never gives more
than 750 audio tokens. The tiny checkpoint keeps that window and the 128 mel bins; only the widths are tiny.
"""
from __future__ import annotations

from typing import Any

from transformers import (
    Qwen2AudioConfig,
    Qwen2AudioEncoderConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    Qwen2Config,
    WhisperFeatureExtractor,
)

from epd_builders.families.audio_common import (
    SAMPLING_RATE,
    audio_chat_template,
    token_id,
    train_audio_tokenizer,
    whisper_frames,
    whisper_tokens,
)
from epd_builders.families.common import Built, text_sizes

MODEL_CLASS = Qwen2AudioForConditionalGeneration
AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
AUDIO_MARKUP = AUDIO_BOS + AUDIO_TOKEN + AUDIO_EOS  # the real template writes "Audio N: " + this + "\n"
WINDOW_SECONDS = 30  # the tower's one window; longer clips are cut to it
MEL_BINS = 128
# the decoder's parameters (for TinySpec.lm_scale); everything else is the encoder's: audio_tower, multi_modal_projector
LM_PREFIXES = ("model.language_model.",)


def build(spec: Any) -> Built:
    tok = train_audio_tokenizer(
        [AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS],
        {"audio_token": AUDIO_TOKEN, "audio_bos_token": AUDIO_BOS, "audio_eos_token": AUDIO_EOS},
        # no image input: an image part renders as nothing (the proxy answers 400 before that)
        audio_chat_template("", None, AUDIO_MARKUP),
    )
    audio = Qwen2AudioEncoderConfig(
        num_mel_bins=MEL_BINS, encoder_layers=spec.audio_layers, encoder_attention_heads=spec.audio_heads,
        encoder_ffn_dim=spec.audio_hidden * 2, d_model=spec.audio_hidden, max_source_positions=WINDOW_SECONDS * 50,
    )
    cfg = Qwen2AudioConfig(audio_config=audio, text_config=Qwen2Config(**text_sizes(spec, tok)),
                           audio_token_index=token_id(tok, AUDIO_TOKEN))
    cfg.tie_word_embeddings = False
    fe = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, chunk_length=WINDOW_SECONDS)
    processor = Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok, chat_template=tok.chat_template)
    return Built(cfg, processor, tok)


def audio_tokens(num_samples: int, processor: Any) -> int:
    """The <|AUDIO|> tokens the processor writes for a clip of `num_samples` (at 16 kHz): 25 per second up to the
    window (750 for 30 s and longer)."""
    return whisper_tokens(whisper_frames(num_samples, processor.feature_extractor))
