"""Qwen2-VL / Qwen2.5-VL video through EPD's halves (epd_models/video.py) equals model.generate() token for token,
and the video inputs are right on frames where the answer is known by construction.

transformers' video processor needs torchvision (not installable here), so the reference model is given OUR
pixel_values_videos / video_grid_thw (/ second_per_grid_ts): what is compared is everything after them (vision
features, the video span, the merge, M-RoPE positions with t > 1 and Qwen2.5-VL's time intervals, the connector).
The inputs themselves are checked against transformers' own `patchify` code and by construction (a still video
is its image's patches; alternating frames land in their temporal slots)."""
from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, GenerationConfig

from decoder_service.generate import generate
from decoder_service.prompt import build_prompt
from epd_contracts.embeddings import ImageFeatures
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.video import VideoError, VideoInputs, VideoSettings, video_inputs, video_settings
from tests.factories import make_image, through_connector

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
NUM_NEW = 16
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"  # what Qwen's chat templates write for a video part
FPS = 3.0  # second_per_grid_t = 2/3: Qwen2.5-VL's temporal positions step by 4 * 2/3 = 2.67, truncated: 0, 2, 5


class Halves:
    def __init__(self, model_dir: Path):
        self.vision, self.lm = VisionHalf(model_dir), LanguageHalf(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def halves(tiny_model_dirs: dict[str, Path]) -> dict[str, Halves]:
    return {family: Halves(tiny_model_dirs[family]) for family in FAMILIES}


def _frames() -> list[Image.Image]:
    """5 frames (padded to 6: 3 temporal patches): a red shape turning blue in the last one."""
    return [make_image(168, 112, c) for c in ("red", "red", "red", "red", "blue")]


def _text(parts: str) -> str:
    return f"<|im_start|>user\n{parts}What shape is it?<|im_end|>\n<|im_start|>assistant\n"


def _ids(lm: LanguageHalf, text: str) -> list[int]:
    return list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


def _reference(h: Halves, text: str, video: VideoInputs, image: Image.Image | None = None) -> tuple[list[int], Any]:
    """model.generate() on the prompt as the processor expands it (each placeholder -> its token count) and the
    inputs the processor would give; also the input ids and kwargs (for get_rope_index)."""
    lm, merge = h.lm, h.model.config.vision_config.spatial_merge_size
    kwargs: dict[str, Any] = {"pixel_values_videos": video.pixel_values_videos,
                              "video_grid_thw": torch.tensor([video.video_grid_thw])}
    if h.model.config.model_type == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([video.second_per_grid_t])  # float32, as the processor's
    text = text.replace("<|video_pad|>", "<|video_pad|>" * (int(np.prod(video.video_grid_thw)) // merge**2))
    if image is not None:
        out = h.vision.image_processor(images=[image], return_tensors="pt")
        kwargs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(out["image_grid_thw"].prod()) // merge**2))
    ids = torch.tensor([_ids(lm, text)])
    assert lm.video_token_id is not None
    kwargs["mm_token_type_ids"] = ids.eq(lm.image_token_id).int() + 2 * ids.eq(lm.video_token_id).int()
    cfg = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = h.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **kwargs)
    return out[0, ids.shape[1] :].tolist(), (ids, kwargs)


def _greedy(lm: LanguageHalf, ids: list[int], items: list[ImageFeatures]) -> tuple[list[int], Any]:
    prompt = build_prompt(lm, ids, items)
    return list(generate(lm, prompt, lambda logits: int(torch.argmax(logits)), NUM_NEW, eos_ids=set())), prompt


@pytest.mark.parametrize("family", FAMILIES)
def test_split_video_path_matches_generate(halves: dict[str, Halves], family: str) -> None:
    h = halves[family]
    frames = _frames()
    video = video_inputs(h.vision.image_processor, h.vision.video_settings, frames, FPS)
    assert video.video_grid_thw == (3, 8, 12) and video.second_per_grid_t == pytest.approx(2 / 3)
    [feat] = through_connector([h.vision.encode_video(frames, FPS)])
    assert feat.second_per_grid_t == video.second_per_grid_t and feat.grid_thw == (3, 8, 12)  # carried on the wire
    with torch.no_grad():
        rows = h.model.model.get_video_features(video.pixel_values_videos, torch.tensor([video.video_grid_thw]))
    assert torch.equal(feat.embeds, rows.pooler_output[0])
    ours, prompt = _greedy(h.lm, _ids(h.lm, _text(VIDEO)), [feat])
    want, (ids, kwargs) = _reference(h, _text(VIDEO), video)
    assert prompt.input_ids.tolist() == ids.tolist()
    assert ours == want
    assert len(set(ours)) > 1, "degenerate random model: the comparison would prove little"
    positions, delta = h.lm.position_ids(prompt.input_ids, [feat])
    ref_positions, ref_delta = h.model.model.get_rope_index(
        ids, kwargs["mm_token_type_ids"], video_grid_thw=kwargs["video_grid_thw"],
        second_per_grid_ts=kwargs.get("second_per_grid_ts"))
    assert torch.equal(positions, ref_positions) and delta == int(ref_delta)
    start = ids[0].tolist().index(h.lm.video_token_id)
    temporal = positions[0, 0, start : start + feat.num_tokens].unique().tolist()
    assert temporal == ([start + k for k in (0, 2, 5)] if family == "qwen2_5_vl" else [start + k for k in range(3)])


@pytest.mark.parametrize("family", FAMILIES)
def test_video_and_image_in_one_prompt(halves: dict[str, Halves], family: str) -> None:
    h = halves[family]
    frames, image = _frames()[:4], make_image(112, 168, "orange")
    video = video_inputs(h.vision.image_processor, h.vision.video_settings, frames, FPS)
    items = through_connector([h.vision.encode([image])[0], h.vision.encode_video(frames, FPS)])
    text = _text(IMAGE + "and" + VIDEO)
    ours, _ = _greedy(h.lm, _ids(h.lm, text), items)
    assert ours == _reference(h, text, video, image)[0]
    assert len(set(ours)) > 1
    with pytest.raises(ValueError, match="another order"):
        build_prompt(h.lm, _ids(h.lm, text), items[::-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_still_video_is_its_image(halves: dict[str, Halves], family: str) -> None:
    """4 identical frames: each temporal patch's pixel rows are the image's own (the image processor repeats a
    frame temporal_patch_size times), and so are its vision rows (Qwen attends within one temporal patch)."""
    vision = halves[family].vision
    frame = make_image(168, 112, "green", "triangle")
    video = video_inputs(vision.image_processor, vision.video_settings, [frame] * 4, FPS)
    image = vision.image_processor(images=[frame], return_tensors="pt")
    assert video.video_grid_thw == (2, *image["image_grid_thw"][0].tolist()[1:])
    assert torch.equal(video.pixel_values_videos, torch.cat([image["pixel_values"]] * 2))
    still, [alone] = vision.encode_video([frame] * 4, FPS), vision.encode([frame])
    for rows in still.embeds.chunk(2):
        torch.testing.assert_close(rows, alone.embeds)


def test_alternating_frames_land_in_their_temporal_slots(halves: dict[str, Halves]) -> None:
    """Frames A, B, A (padded with a repeat of the last: A): patch 0 holds (A, B), patch 1 holds (A, A)."""
    vision = halves["qwen2_vl"].vision
    a, b = make_image(112, 112, "red"), make_image(112, 112, "blue", "square")
    video = video_inputs(vision.image_processor, vision.video_settings, [a, b, a], FPS)
    p, t = vision.image_processor.patch_size, vision.image_processor.temporal_patch_size
    slots = video.pixel_values_videos.view(2, -1, 3, t, p, p)  # (grid_t, N, C, T, p, p)

    def frame(im: Image.Image) -> torch.Tensor:  # its patches (N, C, p, p): the image path repeats them T times
        return vision.image_processor(images=[im], return_tensors="pt")["pixel_values"].view(-1, 3, t, p, p)[:, :, 0]

    assert not torch.equal(frame(a), frame(b))
    for (patch, slot), im in zip([(0, 0), (0, 1), (1, 0), (1, 1)], [a, b, a, a], strict=True):
        assert torch.equal(slots[patch, :, :, slot], frame(im))


def _transformers_patchify() -> Any:
    """`Qwen2VLVideoProcessor.patchify` of the installed transformers, compiled from its source (the module itself
    imports torchvision, so it cannot be imported here)."""
    spec = importlib.util.find_spec("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "patchify")
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), spec.origin, "exec"), namespace)  # noqa: S102
    return namespace["patchify"]


def test_patches_equal_transformers_patchify(halves: dict[str, Halves]) -> None:
    """Our temporal regrouping of the image path's frames == the video processor's own patchify (padding
    included) on the same normalised frames."""
    ip = halves["qwen2_5_vl"].vision.image_processor
    frames = [make_image(168, 112, c) for c in ("red", "blue", "green")]
    video = video_inputs(ip, halves["qwen2_5_vl"].vision.video_settings, frames, FPS)
    p, m = ip.patch_size, ip.merge_size
    single = ip(images=frames, temporal_patch_size=1, return_tensors="pt")  # each frame's (C, p, p) rows
    gh, gw = single["image_grid_thw"][0, 1:].tolist()
    # back to (F, C, H, W): rows are (gh/m, gw/m, m, m) x (C, p, p), as the image processor's patchify wrote them
    stack = single["pixel_values"].view(3, gh // m, gw // m, m, m, 3, p, p).permute(0, 5, 1, 3, 6, 2, 4, 7)
    stack = stack.reshape(1, 3, 3, gh * p, gw * p)
    patches, grid_t, grid_h, grid_w = _transformers_patchify()(None, stack, p, m, ip.temporal_patch_size)
    assert (grid_t, grid_h, grid_w) == video.video_grid_thw
    assert torch.equal(patches[0], video.pixel_values_videos)


def test_settings_come_from_the_video_processor_config(tmp_path: Path, halves: dict[str, Halves]) -> None:
    ip = halves["qwen2_vl"].vision.image_processor
    assert video_settings(tmp_path, ip) == VideoSettings(784, 224 * 224, 14, 2, 2)  # none: the image processor's
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 100_000}))
    assert video_settings(tmp_path, ip).max_pixels == 100_000  # legacy checkpoints: read by the video processor too
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_processor": {}, "video_processor": {"size": {"shortest_edge": 1568, "longest_edge": 3136},
                                                    "image_mean": [0.5] * 3}}))
    settings = video_settings(tmp_path, ip)
    assert (settings.min_pixels, settings.max_pixels, dict(settings.overrides)) == (1568, 3136, {"image_mean": [0.5] * 3})
    video = video_inputs(ip, settings, [make_image(224, 224)] * 2, 2.0)
    assert video.video_grid_thw == (1, 4, 4)  # 56x56 = 3136 pixels at most
    assert video_inputs(ip, settings, [make_image(224, 224)] * 2, 2.0, max_pixels=112 * 112).video_grid_thw == (1, 8, 8)


def test_bad_videos_are_refused_before_pixel_work(halves: dict[str, Halves]) -> None:
    vision = halves["qwen2_vl"].vision
    ip, settings = vision.image_processor, vision.video_settings
    big = [make_image(224, 224)] * 8

    class Untouchable:  # the image processor is never called for a refused video
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"touched {name}")

    with pytest.raises(VideoError, match="over the limit"):
        video_inputs(Untouchable(), settings, big, 2.0, max_bytes=1 << 20)
    for frames, fps, why in [([], 2.0, "at least one frame"), (big, 0.0, "fps"), (big, float("nan"), "fps"),
                             ([make_image(224, 224), make_image(112, 112)], 2.0, "one size"),
                             ([make_image(1000, 4)], 2.0, "aspect ratio")]:
        with pytest.raises(VideoError, match=why):
            video_inputs(Untouchable(), settings, frames, fps)
    assert video_inputs(ip, settings, big, 2.0).video_grid_thw == (4, 16, 16)
    with pytest.raises(ValueError, match="second_per_grid_t"):
        ImageFeatures(torch.zeros(4, 8), (2, 2, 4), second_per_grid_t=float("inf"))
