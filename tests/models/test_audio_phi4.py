"""Phi-4-multimodal's audio through EPD's halves equals model.generate() token for token: one clip, two
clips, and a clip longer than its 40 s attention window, encoded whole and as chunks of whole windows (their rows
concatenated are the whole clip's, bit for bit). The encoder half is embed_tokens_extend's audio part only, the LM
half the base model without its towers; image input is refused (no image processor without torchvision)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

from decoder_service.generate import generate
from decoder_service.prompt import build_prompt
from epd_builders.audio_tiny import SAMPLING_RATE, AudioTinySpec, build_audio_tiny, model_class, window_seconds
from epd_builders.families.phi4_multimodal import audio_tokens
from epd_contracts.audio import AudioConfig
from epd_contracts.embeddings import ImageFeatures
from epd_models.audio import AudioClip, AudioError
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import through_connector

NUM_NEW = 12
QUESTION = "What is it?"
LONG = window_seconds("phi4_multimodal") + 5.0  # 45 s: two windows, the second one 63 rows


def tone(seconds: float, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    return (0.5 * np.sin(2 * np.pi * freq * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


class Halves:
    def __init__(self, model_dir: Path):
        self.vision, self.lm = VisionHalf(model_dir), LanguageHalf(model_dir)
        self.model = model_class("phi4_multimodal").from_pretrained(model_dir).eval()
        self.processor = self.vision.processor

    def text(self, num_audios: int) -> str:
        parts = [{"type": "audio"}] * num_audios + [{"type": "text", "text": QUESTION}]
        return str(self.processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                      add_generation_prompt=True))

    def ours(self, items: list[ImageFeatures], lora: int = 0) -> Run:
        """Our halves' answer (`lora`: under that LoRA slot of self.lm.lora)."""
        items = [f.as_audio() for f in through_connector(items)]  # the flag does not travel: the decoder sets it
        ids = list(self.lm.tokenizer(self.text(len(items)), add_special_tokens=False)["input_ids"])
        prompt = replace(build_prompt(self.lm, ids, items), lora=lora)
        seen: list[torch.Tensor] = []

        def choose(logits: torch.Tensor) -> int:
            seen.append(logits.reshape(-1).clone())
            return int(torch.argmax(logits))

        tokens = list(generate(self.lm, prompt, choose, NUM_NEW, eos_ids=set()))
        return Run(tokens, prompt.input_ids, torch.stack(seen))

    def reference(self, clips: list[np.ndarray]) -> Run:
        inputs = self.processor(text=self.text(len(clips)), audio=clips, sampling_rate=SAMPLING_RATE,
                                return_tensors="pt")
        cfg = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
        out = self.model.generate(**inputs, generation_config=cfg)
        ids = inputs["input_ids"]
        return Run(out.sequences[0, ids.shape[1]:].tolist(), ids, torch.stack([step[0] for step in out.logits]))


@dataclass
class Run:
    tokens: list[int]
    input_ids: torch.Tensor  # (1, L): the prompt, placeholders expanded
    logits: torch.Tensor  # (steps, vocab): what each token was chosen from

    def check(self, want: Run) -> None:
        """The same prompt ids and greedy tokens; the logits too (bit for bit on this CPU: a tolerance for others,
        the tiny random LM's tokens alone repeat too much to prove a lot)."""
        assert self.input_ids.tolist() == want.input_ids.tolist()
        assert self.tokens == want.tokens
        torch.testing.assert_close(self.logits, want.logits, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("phi4-audio")
    return build_audio_tiny(AudioTinySpec(family="phi4_multimodal", lm_scale=3.0), root / "phi4")


@pytest.fixture(scope="module")
def phi4(model_dir: Path) -> Halves:
    return Halves(model_dir)


# two clips of one length: transformers batches them without padding (see test_clips_are_encoded_alone)
@pytest.mark.parametrize("seconds", [(1.3,), (2.5, 2.5), (LONG,)], ids=["one-clip", "two-clips", "longer-than-window"])
def test_matches_generate(phi4: Halves, seconds: tuple[float, ...]) -> None:
    clips = [tone(s, 300.0 + 200 * i) for i, s in enumerate(seconds)]
    want = phi4.reference(clips)
    phi4.ours(phi4.vision.encode_audios([AudioClip(c) for c in clips])).check(want)
    tokens = int(torch.eq(want.input_ids, int(phi4.processor.audio_token_id)).sum())
    assert tokens == sum(audio_tokens(len(c), phi4.processor) for c in clips)  # 12.5 a second, never cut


@torch.inference_mode()
def test_chunks_concatenate_to_the_whole_clip(phi4: Halves) -> None:
    """A 45 s clip as windows [0, 1) and [1, end), each encoded from its own samples, concatenated: the whole clip's
    rows bit for bit, and generate()'s tokens."""
    clip = tone(LONG)
    [whole] = phi4.vision.encode_audios([AudioClip(clip)])
    chunks = phi4.vision.encode_audios([AudioClip(clip, 0, 1), AudioClip(clip, 1, 0)])
    assert [c.num_tokens for c in chunks] == [500, 63]
    joined = torch.cat([c.embeds for c in chunks])
    assert torch.equal(joined, whole.embeds)
    phi4.ours([ImageFeatures(embeds=joined, audio=True)]).check(phi4.reference([clip]))
    with pytest.raises(AudioError, match="past the clip's end"):
        phi4.vision.encode_audios([AudioClip(tone(30.0), 1, 0)])
    with pytest.raises(AudioError, match="shorter than 400 samples"):
        phi4.vision.encode_audios([AudioClip(np.zeros(399, np.float32))])


@torch.inference_mode()
def test_clips_are_encoded_alone(phi4: Halves) -> None:
    """Each clip's rows are transformers' rows for it processed alone. (Clips of different lengths in ONE processor
    call differ there: the shorter one's padding is added to its attention scores as 0, not masked.) With an image
    in the prompt the "vision_speech" projection is taken, as transformers takes it."""
    emb = phi4.model.model.embed_tokens_extend.audio_embed
    fe = phi4.processor.audio_processor
    clips = [tone(1.3, 300.0), tone(2.5, 500.0)]
    got = phi4.vision.encode_audios([AudioClip(c) for c in clips] + [AudioClip(clips[0], with_image=True)])
    for clip, feat, mode in [(clips[0], got[0], "speech"), (clips[1], got[1], "speech"), (clips[0], got[2], "vision")]:
        inputs = fe(clip, sampling_rate=SAMPLING_RATE, return_tensors="pt")
        embeds = torch.zeros(1, feat.num_tokens, emb.config.hidden_size)
        ids = torch.full((1, feat.num_tokens), int(phi4.processor.audio_token_id))
        want = emb(ids, embeds, inputs["audio_input_features"], inputs["audio_embed_sizes"],
                   audio_projection_mode=mode)[0]
        assert torch.equal(feat.embeds, want), mode


def test_halves_hold_their_parts_only(phi4: Halves, model_dir: Path, tmp_path: Path) -> None:
    v, lm = phi4.vision, phi4.lm
    assert v.audio_config == AudioConfig(sample_rate=SAMPLING_RATE, window_seconds=40.0, max_seconds=0.0)
    assert v.image_processor is None and lm.image_token_id == lm.placeholder_id == -1 and lm.video_token_id is None
    assert lm.audio_token_id == phi4.processor.audio_token_id
    assert [n for n, _ in v.module.named_children()] == ["embed_tokens_extend"]
    assert {k.split(".")[1] for k in v.module.state_dict()} == {"audio_embed"}
    assert lm.module.language_model.embed_tokens_extend is None
    assert not [k for k in lm.module.state_dict() if "embed_tokens_extend" in k]
    with pytest.raises(ValueError, match="image input is not supported"):
        v.encode([object()])  # type: ignore[list-item]
    # a checkpoint without the image tower loads as well: its keys are never needed
    copy = tmp_path / "no-image"
    copy.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (copy / f.name).write_bytes(f.read_bytes())
    state = load_file(str(model_dir / "model.safetensors"))
    save_file({k: t for k, t in state.items() if ".image_embed." not in k}, str(copy / "model.safetensors"),
              metadata={"format": "pt"})
    [a] = VisionHalf(copy).encode_audios([AudioClip(tone(1.0))])
    [b] = v.encode_audios([AudioClip(tone(1.0))])
    assert torch.equal(a.embeds, b.embeds)


def test_a_tied_checkpoint_loads_its_lm_head_from_the_embeddings(model_dir: Path, tmp_path: Path) -> None:
    """Saved tied (no lm_head on disk, tie_word_embeddings true): transformers loads it as Phi4MultimodalForCausalLM,
    a multimodal LM rather than an image-text-to-text model, and its tied keys are that class's."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied"
    shutil.copytree(model_dir, tied)
    tensors = {k: v for k, v in load_file(str(model_dir / "model.safetensors")).items() if k != "lm_head.weight"}
    save_file(tensors, str(tied / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    lm = LanguageHalf(tied)
    assert lm.module.lm_head.weight.data_ptr() == lm.module.language_model.embed_tokens.weight.data_ptr()
