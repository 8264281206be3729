"""Qwen2.5-Omni's `use_audio_in_video` through EPD's halves: a video and its sound track, interleaved by 2 s chunks,
equal model.generate(use_audio_in_video=True) token for token, with the prompt laid out as the processor's
`replace_video_with_audio_token` lays it out and the positions `get_rope_index` gives.

The video has 7 temporal patches (14 frames at 3 fps: temporal positions 0, 16, 33, 50, 66, 83, 100, so 3 chunks of
50 positions: 3, 3 and 1 patches) and its 4.7 s track 117 rows (chunks of 50, 50 and 17): the prompt's media run is
V420 A50 V420 A50 V140 A17 between <|audio_bos|> and <|audio_eos|>. A standalone clip after it keeps its own
placeholder. The reference's inputs are made as the processor makes them, piece by piece (its video processor needs
torchvision): the video's as in tests/models/test_audio_omni.py, the audio features by the processor's feature
extractor over both clips in prompt order (the track first), the text by its own replacement method."""
from __future__ import annotations

from itertools import groupby
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GenerationConfig
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

from decoder_service.generate import generate
from decoder_service.prompt import build_prompt
from epd_builders.audio_tiny import SAMPLING_RATE, AudioTinySpec, build_audio_tiny
from epd_contracts.embeddings import ImageFeatures
from epd_models.audio import AudioClip
from epd_models.video import video_inputs
from tests.factories import make_image, through_connector
from tests.models.test_audio_omni import FPS, NUM_NEW, Omni, tone

COLORS = ("red", "red", "blue", "blue", "green", "green", "yellow", "yellow", "red", "blue", "green", "white",
          "black", "black")  # 14 frames: 7 temporal patches


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Omni:
    root = tmp_path_factory.mktemp("audio-in-video")
    return Omni(build_audio_tiny(AudioTinySpec(family="qwen2_5_omni", lm_scale=3.0), root / "omni"))


def processor_span(omni: Omni, grid: tuple[int, int, int], spg: float, track_rows: int) -> str:
    """The processor's own text for a video with its track (`replace_video_with_audio_token`, on the pieces it
    reads: our processor has no video processor)."""
    p = omni.processor
    fake = SimpleNamespace(video_processor=SimpleNamespace(merge_size=omni.merge), audio_bos_token=p.audio_bos_token,
                           audio_eos_token=p.audio_eos_token, video_token=p.video_token, audio_token=p.audio_token,
                           get_chunked_index=lambda idx, n: Qwen2_5OmniProcessor.get_chunked_index(p, idx, n))
    return str(Qwen2_5OmniProcessor.replace_video_with_audio_token(
        fake, {"video_grid_thw": [np.array(grid)], "video_second_per_grid": [spg]}, 0,
        {"num_audio_tokens": [track_rows]}, 0, position_id_per_seconds=25, seconds_per_chunk=2.0))


def reference(omni: Omni, video: Any, clips: list[Any], track_rows: int, clip_rows: int
              ) -> tuple[list[int], dict[str, Any], torch.Tensor]:
    text = omni.text(["video", "audio"])
    text = text.replace("<|VIDEO|>", processor_span(omni, video.video_grid_thw, video.second_per_grid_t, track_rows))
    text = text.replace("<|audio_bos|><|AUDIO|>", "<|audio_bos|>" + "<|AUDIO|>" * clip_rows, 1)
    ids = torch.tensor([omni.lm.tokenizer(text, add_special_tokens=False)["input_ids"]])
    feats = omni.processor.feature_extractor(clips, sampling_rate=SAMPLING_RATE, padding="max_length",
                                             return_attention_mask=True, return_tensors="pt")
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "input_features": feats["input_features"],
              "feature_attention_mask": feats["attention_mask"], "pixel_values_videos": video.pixel_values_videos,
              "video_grid_thw": torch.tensor([video.video_grid_thw]),
              "video_second_per_grid": torch.tensor([video.second_per_grid_t])}
    cfg = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
    out = omni.model.generate(**inputs, generation_config=cfg, use_audio_in_video=True)
    return out.sequences[0, ids.shape[1]:].tolist(), inputs, torch.cat(out.logits)


@torch.inference_mode()
def test_a_video_with_its_sound_track_matches_generate(omni: Omni) -> None:
    vision, lm = omni.vision, omni.lm
    assert vision.audio_config is not None and vision.audio_config.in_video
    frames = [make_image(168, 112, c) for c in COLORS]
    track, clip = tone(4.7, 330.0), tone(1.3, 520.0)
    video = vision.encode_video(frames, FPS)
    rows = vision.encode_audios([AudioClip(track), AudioClip(clip)])
    got = through_connector([video, *rows])  # the flags do not travel: the decoder sets them from its refs
    items = [got[0], got[1].as_audio(in_video=True), got[2].as_audio()]
    assert (video.grid_thw, items[1].num_tokens, items[2].num_tokens) == ((7, 20, 28), 117, 32)
    ids = list(lm.tokenizer(omni.text(["video", "audio"]), add_special_tokens=False)["input_ids"])
    prompt = build_prompt(lm, ids, items)
    logits: list[torch.Tensor] = []

    def choose(step: torch.Tensor) -> int:
        logits.append(step.float().cpu().view(-1))
        return int(torch.argmax(step))

    ours = list(generate(lm, prompt, choose, NUM_NEW, eos_ids=set()))

    ref_video = video_inputs(vision.image_processor, vision.video_settings, frames, FPS)
    want, inputs, want_logits = reference(omni, ref_video, [track, clip], 117, 32)
    assert prompt.input_ids.tolist() == inputs["input_ids"].tolist()
    media = [t for t in prompt.input_ids[0].tolist() if t in (lm.video_token_id, lm.audio_token_id)]
    runs = [(t, len(list(g))) for t, g in groupby(media)]
    v, a = lm.video_token_id, lm.audio_token_id
    assert runs == [(v, 420), (a, 50), (v, 420), (a, 50), (v, 140), (a, 17 + 32)]  # the standalone clip's 32 last
    positions, delta = lm.position_ids(prompt.input_ids, items)
    want_positions, want_delta = omni.model.model.get_rope_index(
        inputs["input_ids"], None, inputs["video_grid_thw"], inputs["attention_mask"], True,
        inputs["feature_attention_mask"].sum(-1), inputs["video_second_per_grid"])
    assert torch.equal(positions, want_positions) and delta == int(want_delta)
    assert ours == want
    # the random model answers one token over a long video, so every step's logits carry the comparison (the split
    # LM runs its own attention path: 1e-5)
    torch.testing.assert_close(torch.stack(logits), want_logits, rtol=0, atol=1e-5)


def test_the_track_must_follow_its_video(omni: Omni) -> None:
    lm, vision = omni.lm, omni.vision
    [rows] = vision.encode_audios([AudioClip(tone(1.0))])
    ids = list(lm.tokenizer(omni.text(["audio"]), add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match="does not follow a video"):
        build_prompt(lm, ids, [rows.as_audio(in_video=True)])
    with pytest.raises(ValueError, match="video's sound track"):
        ImageFeatures(embeds=rows.embeds, in_video=True)


def test_families_without_it_refuse_a_track(tmp_path: Path) -> None:
    """Qwen2-Audio takes audio but no video: its adapter says so for a track (the proxy never sends one: its
    AudioConfig has in_video false)."""
    from epd_models.halves import LanguageHalf

    lm = LanguageHalf(build_audio_tiny(AudioTinySpec(family="qwen2_audio"), tmp_path / "qa"))
    video = ImageFeatures(embeds=torch.zeros(4, 8), grid_thw=(1, 4, 4), second_per_grid_t=1.0)
    with pytest.raises(ValueError, match="do not interleave"):
        lm.adapter.video_track_span(lm.config, video, ImageFeatures(embeds=torch.zeros(2, 8), audio=True))
