"""Qwen2-Audio: a Whisper-style audio tower (conv, transformer, 2x pooling) and a linear projector in front of a
Qwen2 LM; no image input.

The tower takes one 30 s window: the processor pads every clip to 3000 mel frames and cuts longer ones there (the
feature extractor's truncation), so a clip is one item, never split (window 0), at most 750 rows. The tower's
attention masks the padding (its mask over the conv frames, as Qwen2AudioModel.forward builds it), and a clip's rows
are the first of the pooled rows, as many as `_get_feat_extract_output_lengths` counts for its valid frames.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import create_bidirectional_mask

from epd_contracts.audio import AudioConfig
from epd_models.audio import AudioClip, AudioError, feature_rate
from epd_models.base import FamilyAdapter, _to


class Qwen2AudioAdapter(FamilyAdapter):
    """Audio in, text out: the generic adapter's keys and LM half, its own audio hooks."""

    def image_token_id(self, cfg: Any) -> int:
        return -1  # no image token (no token matches -1: an image never reaches this family)

    def audio_token_id(self, cfg: Any) -> int | None:
        return int(cfg.audio_token_index)

    def video_token_id(self, cfg: Any) -> int | None:
        return None

    def placeholder_id(self, cfg: Any) -> int:
        return -1  # no image placeholder: every <|AUDIO|> is a clip's (splice_media gives it the audio kind)

    def audio_config(self, cfg: Any, processor: Any) -> AudioConfig | None:
        fe = processor.feature_extractor
        return AudioConfig(sample_rate=feature_rate(processor), max_seconds=float(fe.chunk_length))

    def encode_audios(self, module: Any, processor: Any, cfg: Any, clips: list[AudioClip]) -> list[torch.Tensor]:
        out = []
        for clip in clips:  # one at a time: each clip is a full 30 s window already
            if not clip.first == clip.count == 0:
                raise AudioError("Qwen2-Audio encodes a clip whole (its one 30 s window): no chunks")
            out.append(self._rows(module, processor, clip))
        return out

    def _rows(self, module: Any, processor: Any, clip: AudioClip) -> torch.Tensor:
        fe = processor.feature_extractor
        inputs = fe(clip.samples, sampling_rate=feature_rate(processor), return_attention_mask=True,
                    padding="max_length", return_tensors="pt")
        weight = next(module.parameters())
        feats, mask = _to(inputs["input_features"], weight), inputs["attention_mask"].to(weight.device)
        tower = module.audio_tower
        conv_lens, out_lens = tower._get_feat_extract_output_lengths(mask.sum(-1))
        frames = (feats.shape[-1] - 2) // 2 + 1  # the tower's conv frames (its second conv has stride 2)
        valid = (torch.arange(frames, device=weight.device)[None, :] < conv_lens[:, None]).long()
        attn = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(1, frames, 1, device=weight.device,
                                                                                       dtype=weight.dtype),
                                         attention_mask=valid)
        hidden = module.multi_modal_projector(tower(feats, attention_mask=attn).last_hidden_state)
        return hidden[0, : int(out_lens[0])]
