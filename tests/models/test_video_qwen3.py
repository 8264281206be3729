"""Qwen3-VL's own video rules: time stamps per temporal patch, the frame size set by the whole video's pixel
budget, DeepStack on video positions (tests/models/test_video_parity.py compares the whole path with generate())."""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from decoder_service.generate import generate
from decoder_service.prompt import Prompt, build_prompt
from epd_models.halves import LanguageHalf
from epd_models.qwen3_vl import DeepStackState
from epd_models.video import QWEN3_VIDEO_SIZE, VideoError, VideoSettings, resized_size, video_inputs, video_settings
from epd_models.video_qwen3 import patch_times
from tests.factories import make_image
from tests.models.test_video_parity import FPS, NUM_NEW, Halves, at_size, chat, frames5, reference, token_ids

FAMILY = "qwen3_vl"


@pytest.fixture(scope="module")
def h(tiny_model_dirs: dict[str, Path]) -> Halves:
    return Halves(FAMILY, tiny_model_dirs[FAMILY])


def test_patch_times_are_transformers_timestamps() -> None:
    """`_calculate_timestamps` (on frame indices and the video's fps) == patch_times on the frames' times."""
    rng = random.Random(0)
    for _ in range(200):
        fps = rng.choice([24.0, 29.97, 30000 / 1001, 12.5, 1.0])
        indices = sorted(rng.sample(range(500), rng.randint(1, 9)))
        want = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)  # type: ignore[arg-type]
        assert patch_times([i / fps for i in indices], 2) == want


def test_span_writes_each_patch_time_and_group(h: Halves) -> None:
    """Frames at 0, 1, 2, 3, 4 seconds (the last repeated to a whole patch): patches at 0.5, 2.5 and 4.0 seconds."""
    feat = h.vision.encode_video(frames5(), FPS, frame_times=[0.0, 1.0, 2.0, 3.0, 4.0])
    assert feat.grid_thw is not None and feat.span is not None
    per_patch = feat.num_tokens // feat.grid_thw[0]
    group = "<|vision_start|>" + "<|video_pad|>" * per_patch + "<|vision_end|>"
    text = h.lm.tokenizer.decode(list(feat.span))
    assert text == f"<0.5 seconds>{group}<2.5 seconds>{group}<4.0 seconds>{group}"
    assert sum(t == h.lm.video_token_id for t in feat.span) == feat.num_tokens


def test_still_video_is_its_image(h: Halves) -> None:
    """4 identical frames: each temporal patch's pixel rows are the image's at the same size, and its rows and
    DeepStack features are the image's (Qwen3-VL attends within one temporal patch)."""
    vision = h.vision
    frame = make_image(224, 224, "green", "triangle")
    video = video_inputs(vision.image_processor, vision.video_settings, [frame] * 4, FPS)
    assert video.video_grid_thw == (2, 14, 14)  # 4 * 224 * 224 is within the video's [min, max] pixels
    image = at_size(vision.image_processor, [frame], video.video_grid_thw, vision.video_settings.patch_size)
    assert torch.equal(video.pixel_values_videos, torch.cat([image["pixel_values"]] * 2))
    still = vision.encode_video([frame] * 4, FPS)
    with torch.no_grad():
        alone = h.model.model.get_image_features(image["pixel_values"], image["image_grid_thw"])
    assert still.deepstack is not None
    first, second = still.embeds.chunk(2)
    assert torch.equal(first, second)  # one forward: the two patches' rows are computed alike
    torch.testing.assert_close(first, alone.pooler_output[0])  # another forward over half the rows: allclose
    for layer, deep in zip(still.deepstack, alone.deepstack_features, strict=True):
        for rows in layer.chunk(2):
            torch.testing.assert_close(rows, deep[0])


def test_frame_size_is_transformers_rule() -> None:
    """Our frame size for a whole video == Qwen3VLVideoProcessor's own patch count arithmetic, with and without
    its per-frame cap, for frame counts odd and even and frames small and large."""
    count: Any = Qwen3VLVideoProcessor.get_num_of_video_patches  # on a stand-in for the processor (torchvision)
    for cap in (False, True):
        stub = SimpleNamespace(size=QWEN3_VIDEO_SIZE, patch_size=16, merge_size=2, temporal_patch_size=2,
                               cap_pixels_per_frame=cap, max_video_tokens=768)
        settings = VideoSettings(QWEN3_VIDEO_SIZE["shortest_edge"], QWEN3_VIDEO_SIZE["longest_edge"], 16, 2, 2,
                                 pixels_per_video=True, frame_cap=768 * 32 * 32 if cap else None)
        for frames in (2, 3, 5, 16, 64, 301):
            for height, width in ((112, 168), (480, 640), (1080, 1920), (20, 700)):
                rh, rw = resized_size(settings, width, height, frames)
                patches = (frames + frames % 2) // 2 * (rh // 16) * (rw // 16)
                assert patches == count(stub, frames, height, width)


def test_one_frame_is_not_a_video(h: Halves) -> None:
    """Its video processor refuses fewer frames than a temporal patch (smart_resize's `t` check)."""
    with pytest.raises(VideoError, match="at least 2 frames"):
        h.vision.encode_video([make_image(112, 112)], FPS)


def test_settings_come_from_the_video_processor_config(tmp_path: Path, h: Halves) -> None:
    ip = h.vision.image_processor
    default = video_settings(tmp_path, ip, FAMILY)  # none: the video processor's default size, over the video
    assert (default.min_pixels, default.max_pixels, default.pixels_per_video) == (131072, 786432, True)
    config = {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16, "temporal_patch_size": 2,
              "merge_size": 2, "max_pixels": 1, "cap_pixels_per_frame": True, "image_mean": [0.5] * 3}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(config))
    assert video_settings(tmp_path, ip, FAMILY) == VideoSettings(  # top-level max_pixels is Qwen2's, not Qwen3's
        4096, 25165824, 16, 2, 2, (("image_mean", [0.5] * 3),), pixels_per_video=True, frame_cap=768 * 32 * 32)


@pytest.mark.parametrize("chunk", [5, 16, 40])
def test_chunked_prefill_adds_deepstack_at_video_positions(h: Halves, chunk: int) -> None:
    """Prefill chunks that cut through the video's groups and time stamps give generate()'s tokens: each chunk
    gets the DeepStack rows of its video positions."""
    frames = frames5()
    feat = h.vision.encode_video(frames, FPS, frame_times=[i / 15.0 for i in range(0, 25, 5)])
    text = chat("<|vision_start|><|video_pad|><|vision_end|>")
    lm: LanguageHalf = h.lm
    prompt = build_prompt(lm, token_ids(lm, text), [feat])
    ours = list(generate(lm, prompt, lambda logits: int(torch.argmax(logits)), NUM_NEW, eos_ids=set(), chunk=chunk))
    assert ours == reference(h, text, frames)[0]
    state = lm.prefill_state(prompt.input_ids, [feat])
    assert isinstance(state, DeepStackState)
    assert int(state.is_image.sum()) == feat.num_tokens  # every video token takes DeepStack rows


def test_deepstack_off_changes_the_answer(h: Halves) -> None:
    """The control: without the video's DeepStack rows the answer differs (the check above is not vacuous)."""
    feat = h.vision.encode_video(frames5(), FPS)
    assert feat.deepstack is not None
    text = chat("<|vision_start|><|video_pad|><|vision_end|>")
    prompt = build_prompt(h.lm, token_ids(h.lm, text), [feat])
    zeroed = build_prompt(h.lm, token_ids(h.lm, text), [feat.with_tensors(feat.embeds, feat.deepstack * 0)])

    def answer(p: Prompt) -> list[int]:
        return list(generate(h.lm, p, lambda logits: int(torch.argmax(logits)), NUM_NEW, eos_ids=set()))

    assert answer(prompt) != answer(zeroed)

