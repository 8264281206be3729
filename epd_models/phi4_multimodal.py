"""Phi-4-multimodal: audio in, text out. A conformer audio encoder (8x conv subsampling, then attention within 500-row
windows) and a two-layer speech projection in front of a Phi-3-style LM; image input is refused (the only image
processor transformers has imports torchvision).

Unlike the composite VLMs there is no language_model child: the LM is Phi4MultimodalModel itself (embed_tokens, layers,
norm, rotary_emb) and the towers hang under it as embed_tokens_extend.{audio_embed,image_embed}. So the checkpoint's
model.embed_tokens_extend.* keys go to the encoder half as embed_tokens_extend.* and every other model.* key to the
LM half as language_model.* (the generic renames with `vision_children=("embed_tokens_extend",)`). The encoder half
holds the audio part only: its image_embed child is None, so a checkpoint's image_embed tensors are read and dropped
by load_state_dict (a None child takes its keys without complaint) and a checkpoint without them loads as well. The
LM half is the base model with embed_tokens_extend None (it is never called when the embeddings are given).

A clip's rows: the feature extractor's log-mel frames (called as the processor calls it), the encoder, then the
speech projection (up, gelu, down; the "vision_speech" weights where the clip's prompt also holds an image, as
transformers picks them). A clip past 500 rows (40 s: 500 rows * 8 frames * 10 ms) is unfolded into 500-row
windows, its last one zero-padded, and each window attends within itself, so a chunk of whole windows is computed
from its own mel frames and the 8 before it (the conv front end's reach, 7 frames, rounded to its stride), and those
frames from their own samples (a frame's log-mel is of its 400 samples only: no clip-wide floor): its rows are
exactly those rows of the whole clip's. The whole clip takes the same path with no frames before it, which is
transformers' own forward op for op (`encode_windows`).

Exactness: equal to transformers' generate() for one clip, and for several clips of the same length. Clips of
different lengths in ONE processor call differ there: transformers pads the shorter ones and adds its padding mask to
the attention scores as 0/1 (not -inf), so a shorter clip's rows see the padding (2.4e-3 on the tiny model) and depend
on the other clips; here every clip is encoded alone, as transformers gives it alone.

The real checkpoint also ships speech and vision LoRA adapters for the LM (PEFT, speech-lora/ and vision-lora/),
which transformers' stock model loads only when asked (PEFT's load_adapter): the decoder applies them to audio and
image requests by default (FamilySpec.shipped_loras, decoder_service/lora_defaults.py), exactly as transformers with
the adapter loaded. Positions are Phi-3's plain 1D ones. The real checkpoint's longrope (its rotary_emb) takes the
short or the long factors for a whole forward from its largest position: equal to generate() while every position
stays within original_max_position_embeddings (4096); past it transformers drops its cache and prefills again with
the long factors, and a packed forward would make one choice for all its rows, so such a checkpoint is served within
original_max_position_embeddings (decoder_service/engine/memory_plan.py checkpoint_max_len; a longer --max-model-len
exits 2).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoModel

from epd_contracts.audio import AudioConfig
from epd_models.audio import AudioClip, AudioError, feature_rate, window_slice
from epd_models.base import FamilyAdapter, LanguageModules, _to

WINDOW_ROWS = 500  # Phi4MultimodalAudioModel.forward's max_seq_len: the encoder attends within windows of 500 rows


class Phi4MultimodalAdapter(FamilyAdapter):
    """Audio in, text out: the LM is the base model itself, the encoder half its embed_tokens_extend.audio_embed."""

    def build_vision(self, cfg: Any) -> nn.Module:
        base = super().build_vision(cfg)  # embed_tokens_extend only (vision_children), parameters on meta
        base.embed_tokens_extend.image_embed = None  # type: ignore[union-attr]
        return base

    def build_language(self, cfg: Any) -> LanguageModules:
        from epd_models.meta import params_on_meta

        with params_on_meta():  # lm_head too: a tied checkpoint has none on disk, and it takes the embeddings'
            lm = AutoModel.from_config(cfg)  # Phi4MultimodalModel: embed_tokens, layers, norm, and the towers
            lm.embed_tokens_extend = None  # never called when the embeddings are given
            return LanguageModules(lm, cfg.hidden_size, cfg.vocab_size)

    def image_token_id(self, cfg: Any) -> int:
        return -1  # no image input (no token matches -1: an image never reaches this family)

    def placeholder_id(self, cfg: Any) -> int:
        return -1  # no image placeholder: every <|endoftext11|> is a clip's (splice_media gives it the audio kind)

    def video_token_id(self, cfg: Any) -> int | None:
        return None

    def audio_token_id(self, cfg: Any) -> int | None:
        return int(cfg.audio_config.audio_token_id)  # <|endoftext11|>: the chat template writes it once per clip

    def audio_config(self, cfg: Any, processor: Any) -> AudioConfig | None:
        fe = processor.audio_processor
        window = WINDOW_ROWS * int(cfg.audio_config.time_reduction) * int(fe.hop_length) / feature_rate(processor)
        return AudioConfig(sample_rate=feature_rate(processor), window_seconds=window)  # never cut (max_seconds 0)

    def encode_audios(self, module: Any, processor: Any, cfg: Any, clips: list[AudioClip]) -> list[torch.Tensor]:
        # one forward per clip: clips of other lengths cannot share one without padding, which the encoder sees
        return [self._rows(module.embed_tokens_extend.audio_embed, processor, clip) for clip in clips]

    def _rows(self, embed: Any, processor: Any, clip: AudioClip) -> torch.Tensor:
        fe = processor.audio_processor
        hop, win = int(fe.hop_length), int(fe.win_length)
        if len(clip.samples) < win:  # the feature extractor's frame: no row at all
            raise AudioError(f"an audio clip shorter than {win} samples has no features")
        total = (len(clip.samples) - win) // hop + 1  # the extractor's frames: one per hop, each of `win` samples
        frames, lead = chunk_frames(total, int(embed.encoder.config.time_reduction), clip)
        # a frame's log-mel is of its own samples only: a chunk's frames are made of its samples alone
        samples = clip.samples[frames.start * hop : (frames.stop - 1) * hop + win]
        feats = fe(samples, sampling_rate=feature_rate(processor), return_tensors="pt")["audio_input_features"]
        weight = embed.up_proj_for_speech.bias
        hidden = encode_windows(embed.encoder, _to(feats, weight), total, lead)
        up, down = ((embed.up_proj_for_vision_speech, embed.down_proj_for_vision_speech) if clip.with_image
                    else (embed.up_proj_for_speech, embed.down_proj_for_speech))
        return down(nn.functional.gelu(up(hidden[None])))[0]


def chunk_frames(total: int, reduction: int, clip: AudioClip) -> tuple[slice, int]:
    """The mel frames (of a clip's `total`) that `clip`'s windows [first, first + count) are computed from, and how
    many of them come before the windows: `reduction` (the conv front end's reach, 7 frames, at its stride), none at
    the clip's start."""
    frames = window_slice(total, WINDOW_ROWS * reduction, clip)
    lead = min(frames.start, reduction)
    return slice(frames.start - lead, frames.stop), lead


def encode_windows(encoder: Any, feats: torch.Tensor, total: int, lead: int) -> torch.Tensor:
    """The encoder rows of some whole windows of a clip of `total` mel frames, from their frames `feats` (1, frames,
    mel) as `chunk_frames` gives them: through the conv front end, the `lead` frames' row dropped; then, where the clip
    is longer than one window, the rows unfolded into 500-row windows, the clip's last one zero-padded, as
    Phi4MultimodalAudioModel.forward does (whose windows attend to those padding rows: the streaming mask is added to
    the scores as 0/1). The whole clip is exactly that forward, op for op; a chunk's rows are exactly the whole clip's
    rows of its windows."""
    cfg = encoder.config
    reduction = int(cfg.time_reduction)
    hidden, _ = encoder.embed(encoder.encoder_embedding(feats), None)
    hidden = hidden[:, lead // reduction :]
    rows = hidden.shape[1]
    if -(-total // reduction) > WINDOW_ROWS:  # the clip's rows: ceil(frames / 8), the front end's output length
        hidden = nn.functional.pad(hidden, (0, 0, 0, -rows % WINDOW_ROWS)).reshape(-1, WINDOW_ROWS, hidden.shape[-1])
    mask = encoder._streaming_mask(hidden.shape[1], hidden.shape[0], cfg.chunk_size, cfg.left_chunk)
    attention = mask.to(hidden.device).unsqueeze(1) + encoder.relative_attention_bias_layer(hidden)
    for layer in encoder.encoders:
        hidden = layer(hidden, attention)
    return hidden.reshape(-1, hidden.shape[-1])[:rows]
