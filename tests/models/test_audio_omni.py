"""Qwen2.5-Omni's thinker through EPD's halves (epd_models/qwen2_5_omni.py) equals model.generate() token for token:
one clip, two clips, a clip with an image, a 7 s clip encoded as chunks of its 2 s windows (on separate calls, as
separate encoders would) and concatenated, and a video with a clip. Besides the tokens: the prompt ids are the
processor's, every step's logits are the model's (to 1e-5: the split LM runs its own attention path), the M-RoPE
positions are `get_rope_index`'s, and a whole clip's rows are `get_audio_features`' bit for bit.

The video's inputs are ours (transformers' video processor needs torchvision), given to the reference model as in
tests/models/test_video_parity.py; its M-RoPE positions exercise Omni's own rules (position_id_per_seconds, and the
text after a video at its largest temporal position + 1)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from decoder_service.generate import generate
from decoder_service.prompt import build_prompt
from epd_builders.audio_tiny import SAMPLING_RATE, AudioTinySpec, build_audio_tiny, model_class
from epd_contracts.embeddings import ImageFeatures
from epd_models import halves
from epd_models.audio import AudioClip, AudioError
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.qwen2_5_omni import clip_features
from epd_models.video import video_inputs
from tests.factories import make_image, through_connector

NUM_NEW = 12
QUESTION = "What is it?"
FPS = 3.0  # 5 frames: 3 temporal patches of 2/3 s, at temporal positions 0, 16, 33 (25 a second)


def tone(seconds: float, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    return (0.5 * np.sin(2 * np.pi * freq * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


class Omni:
    def __init__(self, model_dir: Path):
        self.vision, self.lm = VisionHalf(model_dir), LanguageHalf(model_dir)
        self.model = model_class("qwen2_5_omni").from_pretrained(model_dir).eval()
        self.processor = self.vision.processor
        self.merge = int(self.model.config.vision_config.spatial_merge_size)

    def text(self, kinds: list[str]) -> str:
        parts = [{"type": k} for k in kinds] + [{"type": "text", "text": QUESTION}]
        return str(self.processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                      add_generation_prompt=True))

    def ours(self, kinds: list[str], items: list[ImageFeatures]) -> tuple[list[int], Any, torch.Tensor]:
        """Greedy tokens, the prompt and every step's logits through the halves (items in prompt order)."""
        got = through_connector(items)
        got = [f.as_audio() if k == "audio" else f for k, f in zip(kinds, got, strict=True)]  # set by the decoder
        ids = list(self.lm.tokenizer(self.text(kinds), add_special_tokens=False)["input_ids"])
        prompt = build_prompt(self.lm, ids, got)
        logits: list[torch.Tensor] = []

        def choose(step: torch.Tensor) -> int:
            logits.append(step.float().cpu().view(-1))
            return int(torch.argmax(step))

        return list(generate(self.lm, prompt, choose, NUM_NEW, eos_ids=set())), prompt, torch.stack(logits)

    def reference(self, kinds: list[str], clips: list[np.ndarray], images: list[Any] | None = None,
                  video: Any = None) -> tuple[list[int], dict[str, Any], torch.Tensor]:
        """model.generate() on the processor's inputs (a video's tokens written in as its processor would)."""
        text = self.text(kinds)
        if video is not None:
            text = text.replace("<|VIDEO|>", "", 1)
        kwargs = {"images": images} if images else {}
        inputs = dict(self.processor(text=text, audio=clips, sampling_rate=SAMPLING_RATE, return_tensors="pt",
                                     **kwargs))
        if video is not None:
            ids = inputs["input_ids"][0].tolist()
            at = ids.index(self.model.config.vision_start_token_id) + 1
            ids[at:at] = [self.lm.video_token_id] * (int(np.prod(video.video_grid_thw)) // self.merge**2)
            inputs["input_ids"] = torch.tensor([ids])
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
            inputs.update(pixel_values_videos=video.pixel_values_videos,
                          video_grid_thw=torch.tensor([video.video_grid_thw]),
                          video_second_per_grid=torch.tensor([video.second_per_grid_t]))  # float32, as the processor's
        cfg = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
        out = self.model.generate(**inputs, generation_config=cfg)
        return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), inputs, torch.cat(out.logits)

    def check(self, kinds: list[str], items: list[ImageFeatures], clips: list[np.ndarray], **ref: Any) -> list[int]:
        ours, prompt, logits = self.ours(kinds, items)
        want, inputs, want_logits = self.reference(kinds, clips, **ref)
        assert prompt.input_ids.tolist() == inputs["input_ids"].tolist()
        assert ours == want
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
        positions, delta = self.lm.position_ids(prompt.input_ids, items)
        ref_positions, ref_delta = self.model.model.get_rope_index(
            inputs["input_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), inputs["attention_mask"],
            False, inputs["feature_attention_mask"].sum(-1), inputs.get("video_second_per_grid"))
        assert torch.equal(positions, ref_positions) and delta == int(ref_delta)
        return ours


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Omni:
    root = tmp_path_factory.mktemp("audio-omni")
    return Omni(build_audio_tiny(AudioTinySpec(family="qwen2_5_omni", lm_scale=3.0), root / "omni"))


@pytest.mark.parametrize("seconds", [(1.3,), (1.0, 2.5)], ids=["one-clip", "two-clips"])
@torch.inference_mode()
def test_clips_match_generate(omni: Omni, seconds: tuple[float, ...]) -> None:
    clips = [tone(s, 300.0 + 200 * i) for i, s in enumerate(seconds)]
    items = omni.vision.encode_audios([AudioClip(c) for c in clips])
    ours = omni.check(["audio"] * len(clips), items, clips)
    assert len(set(ours)) > 1, "degenerate random model: the comparison would prove little"
    inputs = omni.processor(text=omni.text(["audio"] * len(clips)), audio=clips, sampling_rate=SAMPLING_RATE,
                            return_tensors="pt")
    rows = omni.model.model.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"])
    assert torch.equal(torch.cat([f.embeds for f in items]), rows.last_hidden_state)  # one forward, as the model's
    assert [f.num_tokens for f in items] == [round(s * 25) for s in seconds]  # 25 a second


@torch.inference_mode()
def test_clip_with_an_image_matches_generate(omni: Omni) -> None:
    image, clip = make_image(112, 84, "blue"), tone(3.0)
    items = [*omni.vision.encode([image]), *omni.vision.encode_audios([AudioClip(clip)])]
    assert items[0].grid_thw is not None and not items[0].audio
    ours = omni.check(["image", "audio"], items, [clip], images=[image])
    assert len(set(ours)) > 1


@torch.inference_mode()
def test_chunks_of_windows_match_the_whole_clip(omni: Omni) -> None:
    """A 7 s clip is 4 windows (2 s, 2 s, 2 s, 1 s): chunks [0, 1), [1, 3), [3, end), each on its own call, give the
    whole clip's rows to the last bits (the tower's kernels see other batch sizes), and generate() equal. The clip
    grows louder, so a chunk's features made from its own samples alone would differ (the log-mel floor)."""
    clip = tone(7.0) * np.linspace(0.02, 1.0, 7 * SAMPLING_RATE, dtype=np.float32)
    [whole] = omni.vision.encode_audios([AudioClip(clip)])
    chunks = [omni.vision.encode_audios([AudioClip(clip, first, count)])[0] for first, count in ((0, 1), (1, 2), (3, 0))]
    assert [c.num_tokens for c in chunks] == [50, 100, 25] and all(c.audio for c in chunks)
    joined = ImageFeatures(embeds=torch.cat([c.embeds for c in chunks]), audio=True)
    torch.testing.assert_close(joined.embeds, whole.embeds, rtol=1e-5, atol=1e-6)
    ours = omni.check(["audio"], [joined], [clip])
    assert len(set(ours)) > 1
    with pytest.raises(AudioError, match="past the clip's end"):
        omni.vision.encode_audios([AudioClip(clip, 4, 1)])


@torch.inference_mode()
def test_video_and_clip_match_generate(omni: Omni) -> None:
    """A video (3 temporal patches) then a clip. The random model answers one token over the video's 420 rows, so
    the logits (and the positions, and the rows) carry the comparison."""
    assert "qwen2_5_omni" in halves.VIDEO_FAMILIES
    vision = omni.vision
    settings = vision.video_settings
    size = omni.processor.videos_kwargs["size"]  # what Qwen2_5OmniProcessor passes its video processor
    assert (settings.min_pixels, settings.max_pixels) == (size["shortest_edge"], size["longest_edge"])
    frames = [make_image(168, 112, c) for c in ("red", "red", "red", "red", "blue")]
    clip = tone(2.5)
    video = vision.encode_video(frames, FPS)
    items = [video, *vision.encode_audios([AudioClip(clip)])]
    ref_video = video_inputs(vision.image_processor, settings, frames, FPS)
    omni.check(["video", "audio"], items, [clip], video=ref_video)
    rows = omni.model.model.get_video_features(ref_video.pixel_values_videos,
                                               torch.tensor([ref_video.video_grid_thw])).pooler_output[0]
    assert torch.equal(video.embeds, rows) and video.grid_thw == ref_video.video_grid_thw == (3, 20, 28)
    prompt = build_prompt(omni.lm, list(omni.lm.tokenizer(omni.text(["video"]), add_special_tokens=False)["input_ids"]),
                          [video])
    positions, _ = omni.lm.position_ids(prompt.input_ids, [video])
    start = prompt.input_ids[0].tolist().index(omni.lm.video_token_id)
    assert positions[0, 0, start : start + video.num_tokens].unique().tolist() == [start + k for k in (0, 16, 33)]
    after = start + video.num_tokens  # the text after the video: its largest position (33 > 27 = w - 1) + 1
    assert positions[:, 0, after].tolist() == [start + 34] * 3


def test_audio_config_keys_and_tokens(omni: Omni) -> None:
    vision, lm = omni.vision, omni.lm
    assert vision.audio_config is not None
    assert (vision.audio_config.sample_rate, vision.audio_config.window_seconds, vision.audio_config.max_seconds) == (
        SAMPLING_RATE, 2.0, 300.0)
    cfg = omni.model.config
    assert (lm.audio_token_id, lm.image_token_id, lm.placeholder_id, lm.video_token_id) == (
        cfg.audio_token_id, cfg.image_token_id, cfg.image_token_id, cfg.video_token_id)
    assert {n for n, _ in vision.module.named_children()} == {"audio_tower", "visual"}
    adapter = vision.adapter
    for key, name in [("model.audio_tower.conv1.weight", "audio_tower.conv1.weight"),
                      ("thinker.model.visual.merger.mlp.0.weight", "visual.merger.mlp.0.weight"),
                      ("thinker.model.language_model.norm.weight", "language_model.norm.weight"),
                      ("thinker.lm_head.weight", "lm_head.weight")]:
        assert adapter.normalize_key(key) == name
    assert adapter.is_vision_key("thinker.model.audio_tower.conv1.weight")
    assert not adapter.is_vision_key("thinker.model.language_model.norm.weight")


@pytest.mark.parametrize("samples", [401, 16_000, 16_037, 7 * 16_000 + 159, 300 * 16_000 - 100, 301 * 16_000])
def test_features_over_the_clip_alone_are_the_processors(omni: Omni, samples: int) -> None:
    """clip_features computes the clip's own frames, not 300 s of them, and gives the processor's call's: a clip that
    grows louder (the clip-wide maximum matters), of lengths off the hop, and at and past the cut. Equal to the last
    bit or so (1.2e-7 measured on clips under 0.1 s: the mel projection is one matrix product over all frames, blocked
    by their count)."""
    fe = omni.vision.processor.feature_extractor
    rng = np.random.default_rng(samples)
    wav = (np.linspace(0.05, 0.9, samples) * rng.standard_normal(samples)).astype(np.float32)
    out = fe(wav, sampling_rate=16_000, padding="max_length", return_attention_mask=True, return_tensors="pt")
    want = out["input_features"][0, :, : int(out["attention_mask"].sum())]
    got = clip_features(omni.vision.processor, wav)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=2.5e-7)


def test_the_hubs_composite_checkpoint_serves_its_thinker(omni: Omni, tmp_path: Path) -> None:
    """A checkpoint laid out as the hub's Qwen2.5-Omni (model_type qwen2_5_omni: the thinker's config inside, its keys
    under "thinker.", a talker's beside them) loads both halves from the thinker's parts only, reports the thinker's
    identity, and encodes and answers as the thinker-only checkpoint does."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5OmniConfig

    from epd_models.identity import model_identity

    src = omni.vision.model_dir
    composite = tmp_path / "omni-composite"
    shutil.copytree(src, composite)
    tensors = {f"thinker.{k}": v for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["talker.model.embed_tokens.weight"] = torch.zeros(4, 4)  # a part EPD never serves, and never reads
    save_file(tensors, str(composite / "model.safetensors"), metadata={"format": "pt"})
    Qwen2_5OmniConfig(thinker_config=omni.vision.config.to_dict()).save_pretrained(composite)
    vision, lm = VisionHalf(composite), LanguageHalf(composite)
    assert lm.audio_token_id == omni.lm.audio_token_id and vision.audio_config == omni.vision.audio_config
    identity, alone = model_identity(composite), model_identity(src)
    assert identity["family"] == "qwen2_5_omni" and identity["hidden_size"] == alone["hidden_size"]
    assert (identity["audio"], identity["video"]) == (alone["audio"], alone["video"])
    clip = tone(1.5)
    [ours], [theirs] = vision.encode_audios([AudioClip(clip)]), omni.vision.encode_audios([AudioClip(clip)])
    assert torch.equal(ours.embeds, theirs.embeds)
    ids = list(lm.tokenizer(omni.text(["audio"]), add_special_tokens=False)["input_ids"])
    run = [list(generate(half, build_prompt(half, ids, [ours.as_audio()]), lambda x: int(torch.argmax(x)), 6,
                         eos_ids=set())) for half in (lm, omni.lm)]
    assert run[0] == run[1]
