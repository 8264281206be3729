"""Audio through EPD's halves equals model.generate() token for token, per audio family: one
clip, two clips, and a clip longer than the family's window (Qwen2-Audio: cut at its 30 s window, as its
processor cuts it). The encoder half runs the clip through the connector; the decoder half splices the rows at
the audio token. The reference is transformers' processor and model on the same samples."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from decoder_service.generate import generate
from decoder_service.prompt import build_prompt
from epd_builders.audio_tiny import SAMPLING_RATE, AudioTinySpec, build_audio_tiny, model_class, window_seconds
from epd_contracts.embeddings import ImageFeatures
from epd_models.audio import AudioClip
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import through_connector

NUM_NEW = 12
QUESTION = "What is it?"


def tone(seconds: float, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    return (0.5 * np.sin(2 * np.pi * freq * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


class Halves:
    def __init__(self, family: str, model_dir: Path):
        self.family = family
        self.vision, self.lm = VisionHalf(model_dir), LanguageHalf(model_dir)
        self.model = model_class(family).from_pretrained(model_dir).eval()
        self.processor = self.vision.processor

    def text(self, num_audios: int) -> str:
        parts = [{"type": "audio"}] * num_audios + [{"type": "text", "text": QUESTION}]
        return str(self.processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                      add_generation_prompt=True))

    def ours(self, clips: list[np.ndarray]) -> tuple[list[int], Any]:
        feats = through_connector(self.vision.encode_audios([AudioClip(c) for c in clips]))
        items = [f.as_audio() for f in feats]  # the flag does not travel: the decoder sets it from its request
        ids = list(self.lm.tokenizer(self.text(len(clips)), add_special_tokens=False)["input_ids"])
        prompt = build_prompt(self.lm, ids, items)
        out = generate(self.lm, prompt, lambda logits: int(torch.argmax(logits)), NUM_NEW, eos_ids=set())
        return list(out), prompt

    def reference(self, clips: list[np.ndarray]) -> tuple[list[int], torch.Tensor]:
        inputs = self.processor(text=self.text(len(clips)), audio=clips, sampling_rate=SAMPLING_RATE,
                                return_tensors="pt")
        cfg = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = self.model.generate(**inputs, generation_config=cfg)
        ids = inputs["input_ids"]
        return out[0, ids.shape[1]:].tolist(), ids


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory: pytest.TempPathFactory) -> Halves:
    root = tmp_path_factory.mktemp("audio-parity")
    return Halves("qwen2_audio", build_audio_tiny(AudioTinySpec(family="qwen2_audio", lm_scale=3.0), root / "q"))


@pytest.mark.parametrize("seconds", [(1.3,), (1.0, 2.5), (window_seconds("qwen2_audio") + 4.0,)],
                         ids=["one-clip", "two-clips", "longer-than-window"])
def test_qwen2_audio_matches_generate(qwen2_audio: Halves, seconds: tuple[float, ...]) -> None:
    h = qwen2_audio
    clips = [tone(s, 300.0 + 200 * i) for i, s in enumerate(seconds)]
    ours, prompt = h.ours(clips)
    want, ids = h.reference(clips)
    assert prompt.input_ids.tolist() == ids.tolist()
    assert ours == want
    audio_tokens = int((ids == h.lm.audio_token_id).sum())
    assert audio_tokens == min(sum(round(s * 25) for s in seconds), 750)  # 25 a second, cut at the 30 s window
    if len(seconds) > 1 or seconds[0] < 30:  # past the window the random LM repeats one token for this clip
        assert len(set(ours)) > 1, "degenerate random model: the comparison would prove little"


def test_audio_config_and_kind(qwen2_audio: Halves) -> None:
    h = qwen2_audio
    assert h.vision.audio_config is not None and h.vision.audio_config.sample_rate == SAMPLING_RATE
    assert h.vision.audio_config.window_seconds == 0 and h.vision.audio_config.max_seconds == 30
    [feat] = h.vision.encode_audios([AudioClip(tone(2.0))])
    assert feat.audio and not feat.is_video and feat.num_tokens == 50
    assert isinstance(feat, ImageFeatures)
    assert h.vision.image_processor is None and h.lm.image_token_id == -1  # no image input at all


@pytest.mark.parametrize("family", ["qwen2_audio", "qwen2_5_omni", "phi4_multimodal"])
def test_each_half_holds_its_own_parts(family: str, tmp_path: Path) -> None:
    """The encoder half holds the audio (and vision) towers and projectors only, the decoder half the LM only:
    every checkpoint tensor is read by exactly one half (or, Phi-4's image tower, by neither: it takes no image)."""
    from safetensors import safe_open

    model_dir = build_audio_tiny(AudioTinySpec(family=family), tmp_path / family)
    vision, lm = VisionHalf(model_dir), LanguageHalf(model_dir)
    enc = {n for n, _ in [*vision.module.named_parameters(), *vision.module.named_buffers()]}
    dec = {n for n, _ in [*lm.module.named_parameters(), *lm.module.named_buffers()]}
    assert enc and dec and not enc & dec
    assert not any("language_model" in n or n.startswith("lm_head") for n in enc)
    assert not any(t in n for n in dec for t in ("audio_tower", "audio_embed", "visual.", "multi_modal_projector"))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    read = {k for k in keys if vision.adapter.normalize_key(k) in enc | dec}
    unread = [k for k in keys if k not in read]
    assert all("image_embed" in k for k in unread), unread[:5]
