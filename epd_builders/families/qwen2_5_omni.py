"""Tiny Qwen2.5-Omni thinker checkpoints (text out): a windowed Whisper-style audio tower with its own output
projection, Qwen2.5-VL's vision tower, and a Qwen2 LM with M-RoPE.

Saved as the thinker alone (model_type qwen2_5_omni_thinker, keys model.audio_tower.*, model.visual.*,
model.language_model.*, lm_head.*); a real checkpoint is the composite qwen2_5_omni (thinker_config, talker,
token2wav) with the thinker's keys under "thinker.". The audio settings are the real 7B's: 128 mel bins, clips cut
at 300 s (the feature extractor's chunk_length), and the tower attends within windows of n_window * 2 = 200 mel
frames (2 s, 50 tokens), each encoded on its own (conv, positions and attention restart in every window).
"""
from __future__ import annotations

from typing import Any

from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration, WhisperFeatureExtractor
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoderConfig,
    Qwen2_5OmniTextConfig,
    Qwen2_5OmniVisionEncoderConfig,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from epd_builders.families.audio_common import (
    SAMPLING_RATE,
    audio_chat_template,
    token_id,
    train_audio_tokenizer,
    whisper_frames,
    whisper_tokens,
)
from epd_builders.families.common import Built, text_sizes
from epd_models.audio_processors import Qwen2_5OmniImageAudioProcessor

MODEL_CLASS = Qwen2_5OmniThinkerForConditionalGeneration
# the real tokenizer's strings (<|vision_bos|> is id 151652, Qwen2-VL's <|vision_start|>)
IMAGE, VIDEO, AUDIO = "<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>"
VISION_BOS, VISION_EOS, AUDIO_BOS, AUDIO_EOS = "<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>", "<|audio_eos|>"
IMAGE_MARKUP, VIDEO_MARKUP = VISION_BOS + IMAGE + VISION_EOS, VISION_BOS + VIDEO + VISION_EOS
AUDIO_MARKUP = AUDIO_BOS + AUDIO + AUDIO_EOS
CHUNK_SECONDS = 300  # the feature extractor's chunk_length: clips are cut there
N_WINDOW = 100  # the tower attends within n_window * 2 mel frames
WINDOW_SECONDS = 2  # = N_WINDOW * 2 frames * 160 samples per hop / 16 kHz
MEL_BINS, PATCH, MERGE = 128, 14, 2
LM_PREFIXES = ("model.language_model.",)  # the encoder's: model.audio_tower, model.visual


def build(spec: Any) -> Built:
    tok = train_audio_tokenizer(
        [IMAGE, VIDEO, AUDIO, VISION_BOS, VISION_EOS, AUDIO_BOS, AUDIO_EOS],
        {"image_token": IMAGE, "video_token": VIDEO, "audio_token": AUDIO, "vision_bos_token": VISION_BOS,
         "vision_eos_token": VISION_EOS, "audio_bos_token": AUDIO_BOS, "audio_eos_token": AUDIO_EOS},
        audio_chat_template(IMAGE_MARKUP, VIDEO_MARKUP, AUDIO_MARKUP),
    )
    head_dim = spec.text_hidden // spec.heads
    third = head_dim // 2 // 3
    text = Qwen2_5OmniTextConfig(**text_sizes(spec, tok), rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "mrope_section": [head_dim // 2 - 2 * third, third, third]})
    vision = Qwen2_5OmniVisionEncoderConfig(
        depth=spec.vision_layers, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_hidden * 2,
        num_heads=spec.heads, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=56,
        out_hidden_size=spec.text_hidden, fullatt_block_indexes=[spec.vision_layers - 1],
    )
    audio = Qwen2_5OmniAudioEncoderConfig(
        num_mel_bins=MEL_BINS, encoder_layers=spec.audio_layers, encoder_attention_heads=spec.audio_heads,
        encoder_ffn_dim=spec.audio_hidden * 2, d_model=spec.audio_hidden, max_source_positions=1500,
        n_window=N_WINDOW, output_dim=spec.text_hidden,
    )
    ids: dict[str, Any] = {name: token_id(tok, t) for name, t in (
        ("image_token_index", IMAGE), ("video_token_index", VIDEO), ("audio_token_index", AUDIO),
        ("audio_start_token_id", AUDIO_BOS), ("audio_end_token_id", AUDIO_EOS),
        ("vision_start_token_id", VISION_BOS), ("vision_end_token_id", VISION_EOS))}
    cfg = Qwen2_5OmniThinkerConfig(audio_config=audio, vision_config=vision, text_config=text, **ids)
    cfg.tie_word_embeddings = False
    unit = PATCH * MERGE  # one merged image token covers unit x unit pixels
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": unit * unit, "longest_edge": spec.image_size * spec.image_size},
        patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE)
    fe = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, chunk_length=CHUNK_SECONDS,
                                 return_attention_mask=True)
    processor = Qwen2_5OmniImageAudioProcessor(image_processor=image_processor, feature_extractor=fe, tokenizer=tok,
                                               chat_template=tok.chat_template)
    return Built(cfg, processor, tok)


def audio_tokens(num_samples: int, processor: Any) -> int:
    """The <|AUDIO|> tokens for a clip of `num_samples` (at 16 kHz): 25 per second up to 300 s. The same count as the
    processor's `_get_num_multimodal_tokens(audio_lengths=...)`, which vLLM asks."""
    return whisper_tokens(whisper_frames(num_samples, processor.feature_extractor))


def window_frames(cfg: Any) -> int:
    """Mel frames per independently encoded window (200: 2 s, 50 tokens)."""
    return int(cfg.audio_config.n_window) * 2
