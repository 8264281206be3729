"""Qwen2.5-Omni's thinker (text out): a windowed Whisper-style audio tower with its own projection, Qwen2.5-VL's
vision tower, and a Qwen2 LM with M-RoPE. The encoder half holds both towers (`audio_tower`, `visual`).

Audio: the feature extractor runs over the WHOLE clip, giving what Qwen2_5OmniProcessor's call gives (padded to
its 300 s `chunk_length` with "max_length", cut there, the attention mask giving the valid frames), since a frame's
log-mel value depends on the whole clip (the floor is the clip's maximum - 8). The tower then attends within
windows of `n_window * 2` mel frames (2 s, 50 rows), each encoded on its own (conv, positions and attention restart
in every window, and the 2x pooling pairs never cross a window), so a chunk of whole windows [first, first + count)
is its frames alone through the tower, and its rows are those rows of the whole clip's. Not bit for bit: the tower
batches its windows into one conv and one flat sequence for the linear layers, whose CPU and GPU kernels pick their
blocking by the batch's size, so the same window alone, in a chunk, in the whole clip or beside another request's
clip may differ in the last bits (6e-8 measured for chunks on separate calls; tests allow 1e-6). The clips and chunks
of one `encode_audios` call go through the tower together, as the model's `get_audio_features` takes a prompt's
clips. The features are computed over the clip's own length, not the processor's 300 s pad (`clip_features`: the
pad costs 1 s of CPU a clip here, paid again by each chunk's call), equal to the processor's to about 1e-7.

The audio rows take <|AUDIO|>, the chat template's one placeholder per clip (between <|audio_bos|> and
<|audio_eos|>); their M-RoPE positions are text positions (one a token, the three axes equal), as the model's own
`get_rope_index` gives them. Images are Qwen2.5-VL's (the template writes <|vision_bos|><|IMAGE|><|vision_eos|>,
<|IMAGE|> being the placeholder and the rows' token).

Video (<|VIDEO|>): Qwen2.5-VL's video inputs (epd_models/video.py) through the same visual tower; its temporal
positions are `floor(k * second_per_grid_t * position_id_per_seconds)` in Omni's order of float32 products (Qwen2.5-VL
multiplies `tokens_per_second * second_per_grid_t` first), and the text after any vision item starts at the item's
largest position + 1 (Qwen2.5-VL in transformers 5 at start + max(h, w), which a video's temporal positions exceed).
A video's sound track (`use_audio_in_video`; AudioConfig.in_video): the track is an audio item right after its video
(ImageFeatures.in_video), and the two share the video's placeholder: <|audio_bos|>, then chunk by chunk of
`seconds_per_chunk` (2 s: 50 positions) the video's tokens and the track's whose positions fall in it, then
<|audio_eos|> (`video_track_span`, the processor's `replace_video_with_audio_token`). Positions as `get_rope_index`
gives them with use_audio_in_video: <|vision_bos|> and <|audio_bos|> share one, the video's and the track's both
start after it (the track's one a row), and <|audio_eos|> and <|vision_eos|> share the one after the last chunk's
largest. The frames are sized by the processor's own video size
(its `videos_kwargs`, passed on every call: epd_models/video.py `video_settings`); epd_models/video.py's
VIDEO_FAMILIES lists it, and its workers report its video sampling in /health like the Qwen VL families'.

Checkpoints: the thinker alone (model_type qwen2_5_omni_thinker; keys model.audio_tower.*, model.visual.*,
model.language_model.*, lm_head.*), or the hub's composite qwen2_5_omni (thinker_config, talker_config,
token2wav_config; keys thinker.*, talker.*, token2wav.*): its thinker's config is the served one
(epd_models/registry.py `load_config`), "thinker." is stripped from its keys and the talker's and token2wav's are
never read (`skip_prefixes`), and its processor is built without torchvision (epd_models/audio_processors.py).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerTextModel

from epd_contracts.audio import AudioConfig
from epd_contracts.embeddings import ImageFeatures
from epd_models.audio import AudioClip, feature_rate, window_slice
from epd_models.base import LanguageModules, _to
from epd_models.mrope import MRopeAdapter, Run

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2_5OmniAdapter(MRopeAdapter):
    """Qwen2.5-Omni's thinker: audio, images and videos in, text out."""

    def normalize_key(self, key: str) -> str:
        return super().normalize_key(key.removeprefix("thinker."))  # a composite checkpoint's thinker keys

    def build_language(self, cfg: PretrainedConfig) -> LanguageModules:
        """The thinker's text model (AutoModel knows no qwen2_5_omni_text) and lm_head, parameters on meta."""
        from epd_models.meta import params_on_meta

        tc = cfg.get_text_config()
        with params_on_meta():
            return LanguageModules(Qwen2_5OmniThinkerTextModel._from_config(tc), tc.hidden_size, tc.vocab_size)

    # audio

    def audio_token_id(self, cfg: Any) -> int | None:
        return int(cfg.audio_token_index)

    def audio_config(self, cfg: Any, processor: Any) -> AudioConfig | None:
        fe = processor.feature_extractor
        window = window_frames(cfg) * int(fe.hop_length) / feature_rate(processor)
        return AudioConfig(sample_rate=feature_rate(processor), window_seconds=window,
                           max_seconds=float(fe.chunk_length), in_video=True)

    def video_track_span(self, cfg: Any, video: ImageFeatures, track: ImageFeatures) -> list[int]:
        """<|audio_bos|>, the video's and the track's tokens interleaved chunk by chunk, <|audio_eos|>."""
        tokens: list[int] = []
        video_id, audio_id = int(cfg.video_token_index), int(cfg.audio_token_index)
        for (v0, v1), (a0, a1) in _track_chunks(cfg, self.item_runs(cfg, video)[0], track.num_tokens):
            tokens += [video_id] * (v1 - v0) + [audio_id] * (a1 - a0)
        return [int(cfg.audio_start_token_id), *tokens, int(cfg.audio_end_token_id)]

    def encode_audios(self, module: Any, processor: Any, cfg: Any, clips: list[AudioClip]) -> list[torch.Tensor]:
        """Each clip's (chunk's) rows: the whole clip's features cut to the chunk's windows, every item's frames
        through the tower in one forward (its `feature_lens` keeps them apart), split back per item."""
        weight = next(module.parameters())
        whole: dict[int, torch.Tensor] = {}  # id(samples) -> the clip's valid frames (mel, frames)
        parts = []
        for clip in clips:
            key = id(clip.samples)
            if key not in whole:
                whole[key] = clip_features(processor, clip.samples)
            feats = whole[key]
            parts.append(feats[:, window_slice(feats.shape[1], window_frames(cfg), clip)])
        lens = torch.tensor([p.shape[1] for p in parts], device=weight.device)
        tower = module.audio_tower
        rows = tower(_to(torch.cat(parts, dim=1), weight), feature_lens=lens).last_hidden_state
        _, counts = tower._get_feat_extract_output_lengths(lens)
        return list(torch.split(rows, counts.tolist()))

    # M-RoPE

    def item_runs(self, cfg: PretrainedConfig, item: ImageFeatures) -> list[Run]:
        """One run (the item's whole grid), at Omni's temporal positions: `get_rope_index`'s
        floor(k * second_per_grid_t * position_id_per_seconds) for a video, in its order of float32 products (the
        processor's video_second_per_grid is a float32 tensor); k * position_id_per_seconds for an image (whose one
        temporal patch is at 0)."""
        grid = item.grid_thw
        assert grid is not None, "Qwen image features need grid_thw"
        merge = cfg.vision_config.spatial_merge_size
        temporal = torch.arange(grid[0])
        if item.second_per_grid_t is None:
            temporal = temporal * int(cfg.position_id_per_seconds)
        else:
            per_grid = torch.tensor(item.second_per_grid_t, dtype=torch.float32)
            temporal = (temporal * per_grid * cfg.position_id_per_seconds).long()
        return [(temporal, grid[1] // merge, grid[2] // merge, item.is_video)]

    def position_ids(
        self, cfg: PretrainedConfig, input_ids: torch.Tensor, images: list[ImageFeatures]
    ) -> tuple[torch.Tensor, int]:
        """MRopeAdapter's, but the text after a vision item starts at the item's largest position + 1, and a video
        with its sound track (the audio item after it has in_video) is placed as `get_rope_index` places it with
        use_audio_in_video (see the module docstring)."""
        ids = input_ids.view(-1).tolist()
        media = {self.image_token_id(cfg), self.video_token_id(cfg)} - {None}
        visual = [(im, images[k + 1] if k + 1 < len(images) and images[k + 1].in_video else None)
                  for k, im in enumerate(images) if not im.audio]
        items = iter(visual)
        chunks: list[torch.Tensor] = []
        pos, i = 0, 0
        while i < len(ids):
            j = i
            if ids[i] not in media:
                while j < len(ids) and ids[j] not in media:
                    j += 1
                chunks.append(torch.arange(pos, pos + j - i).view(1, -1).expand(3, -1))
                pos = int(chunks[-1].max()) + 1
                i = j
                continue
            item, track = next(items)
            run = self.item_runs(cfg, item)[0]
            temporal, h, w, is_video = run
            assert is_video == (ids[i] == self.video_token_id(cfg)), "an image's features at a video's tokens"
            if track is None:
                chunks.append(_grid_positions(temporal, h, w) + pos)
                j = i + len(temporal) * h * w
            else:  # <|vision_bos|><|audio_bos|> at one position (the text run gave them two), the block after it
                chunks[-1] = chunks[-1].clone()
                chunks[-1][:, -1] -= 1
                start = pos - 1
                grid, rows = _grid_positions(temporal, h, w) + start, torch.arange(track.num_tokens) + start
                for (v0, v1), (a0, a1) in _track_chunks(cfg, run, track.num_tokens):
                    chunks += [part for part in (grid[:, v0:v1], rows[a0:a1].view(1, -1).expand(3, -1)) if part.numel()]
                end = int(chunks[-1].max()) + 1  # <|audio_eos|><|vision_eos|>: one position after the last chunk
                chunks.append(torch.full((3, 2), end))
                j = i + len(temporal) * h * w + track.num_tokens + 2
            pos = int(chunks[-1].max()) + 1
            i = j
        positions = torch.cat(chunks, dim=1)
        return positions.view(3, 1, -1), pos - len(ids)


def _grid_positions(temporal: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(3, t * h * w) positions of a grid from 0: temporal (per patch, as given), row, column."""
    tt, hh, ww = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1)


def _track_chunks(cfg: Any, run: Run, rows: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The video's tokens [v0, v1) and its track's rows [a0, a1) of each chunk of `seconds_per_chunk`, in order
    (an empty range where one of them has fewer chunks): `get_chunked_index` over the video's temporal positions
    (one per token) and the track's (one per row)."""
    temporal, h, w, _ = run
    per_chunk = int(cfg.position_id_per_seconds * cfg.seconds_per_chunk)
    video = _chunked(temporal.repeat_interleave(h * w).tolist(), per_chunk)
    track = _chunked(list(range(rows)), per_chunk)
    n = max(len(video), len(track))
    pad = [(0, 0)] * n
    return list(zip((video + pad)[:n], (track + pad)[:n], strict=True))


def _chunked(values: list[int], per_chunk: int) -> list[tuple[int, int]]:
    """transformers' `get_chunked_index`: [start, end) ranges of increasing `values`, a new one each time a value
    reaches the next multiple of `per_chunk` (one step per value, as it does)."""
    out, start, current = [], 0, 1
    for i, value in enumerate(values):
        if value >= current * per_chunk:
            out.append((start, i))
            start, current = i, current + 1
    out.append((start, len(values)))
    return out


def clip_features(processor: Any, samples: np.ndarray) -> torch.Tensor:
    """The clip's valid log-mel frames (mel, frames), what Qwen2_5OmniProcessor's call gives (padded with zeros to
    its 300 s `chunk_length`, cut there, the mask's frames kept) without computing 300 s of frames (equal to the last
    bit or so: the mel projection is one matrix product over all the frames, blocked by their count): the clip
    with n_fft zeros after it gives every valid frame the same samples to see (a frame's window reaches at most n_fft
    / 2 past its centre, so it never meets the STFT's reflected edge), and the zero frames cannot move the clip-wide
    maximum (their log-mel is the floor of 1e-10). A clip that reaches the cut is computed as the processor does."""
    fe = processor.feature_extractor
    limit, hop = int(fe.n_samples), int(fe.hop_length)
    samples = samples[:limit]
    valid = math.ceil(len(samples) / hop)
    if len(samples) + int(fe.n_fft) > limit:
        out = fe(samples, sampling_rate=feature_rate(processor), padding="max_length", return_attention_mask=True,
                 return_tensors="pt")
        return out["input_features"][0, :, : int(out["attention_mask"].sum())]
    padded = np.concatenate([samples, np.zeros(int(fe.n_fft), dtype=samples.dtype)])
    out = fe(padded, sampling_rate=feature_rate(processor), padding="longest", return_tensors="pt")
    return out["input_features"][0, :, :valid]


def window_frames(cfg: Any) -> int:
    """Mel frames per independently encoded window: n_window * 2 (200: 2 s, 50 rows)."""
    return int(cfg.audio_config.n_window) * 2
