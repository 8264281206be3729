"""Video through EPD's halves (epd_models/video.py) equals model.generate() token for token, for every family that
takes video (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, LLaVA-OneVision), and the video inputs are right on frames
where the answer is known by construction.

transformers' video processors need torchvision (not installable here), so the reference model is given OUR
pixel_values_videos / video_grid_thw (/ second_per_grid_ts), and the prompt as transformers' own processor code
expands the video placeholder (Qwen3-VL's `replace_video_token` with its time stamps, LLaVA-OneVision's): what is
compared is everything after the pixels (vision features, DeepStack, the span, the merge, M-RoPE positions with
t > 1 and Qwen2.5-VL's time intervals, the connector). The inputs themselves are checked against transformers'
own `patchify` code and by construction (a still video is its image's patches; alternating frames land in their
temporal slots; tests/models/test_video_qwen3.py and test_video_onevision.py for those families' own rules).
tests/models/test_video_chunks.py checks a video encoded in chunks against the whole."""
from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
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
from epd_models.video import VideoClip, VideoError, VideoSettings, video_inputs, video_settings
from epd_models.video_onevision import frame_pixels
from tests.factories import make_image, through_connector

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava_onevision")
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
QWEN3 = ("qwen3_vl", "qwen3_vl_moe")  # DeepStack, and time stamps in a video's span
NUM_NEW = 16
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"  # what Qwen's chat templates write for a video part
FPS = 3.0  # second_per_grid_t = 2/3: Qwen2.5-VL's temporal positions step by 4 * 2/3 = 2.67, truncated: 0, 2, 5
SOURCE_FPS = 15.0  # the source video's rate: sampled frame k is its frame 5 * k, at k / 3 seconds
INDICES = tuple(range(0, 60, 5))


class Halves:
    def __init__(self, family: str, model_dir: Path):
        self.family = family
        self.vision, self.lm = VisionHalf(model_dir), LanguageHalf(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
        self.model.generation_config.eos_token_id = None  # else generate() stops at it: compare NUM_NEW tokens


@pytest.fixture(scope="module")
def halves(tiny_model_dirs: dict[str, Path]) -> dict[str, Halves]:
    return {family: Halves(family, tiny_model_dirs[family]) for family in FAMILIES}


def frames5() -> list[Image.Image]:
    """5 frames (padded to 6 by the Qwen families: 3 temporal patches): a red shape turning blue in the last one."""
    return [make_image(168, 112, c) for c in ("red", "red", "red", "red", "blue")]


def frame_times(num_frames: int) -> list[float]:
    return [i / SOURCE_FPS for i in INDICES[:num_frames]]


def encode_video(h: Halves, frames: list[Image.Image]) -> ImageFeatures:
    return h.vision.encode_video(frames, FPS, frame_times=frame_times(len(frames)))


def video_text(family: str) -> str:
    """The video part as the family's chat template writes it (LLaVA-OneVision's tiny checkpoint: its video
    token, which is <|video_pad|>; a real one's is <video>)."""
    return QWEN_VIDEO if family in QWEN else "<|video_pad|>"


def image_text(family: str) -> str:
    return IMAGE if family in QWEN else "<image>"


def chat(parts: str) -> str:
    return f"<|im_start|>user\n{parts}What shape is it?<|im_end|>\n<|im_start|>assistant\n"


def token_ids(lm: LanguageHalf, text: str) -> list[int]:
    return list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


def reference_video(h: Halves, frames: list[Image.Image]) -> tuple[dict[str, Any], str]:
    """The video's model inputs and the text transformers' processor writes in place of the video token."""
    vision = h.vision
    if h.family == "llava_onevision":
        pixels = frame_pixels(vision.image_processor, vision.video_settings, VideoClip(frames, FPS))[None]
        return {"pixel_values_videos": pixels}, vision.processor.replace_video_token({"pixel_values_videos": pixels}, 0)
    video = video_inputs(vision.image_processor, vision.video_settings, frames, FPS)
    grid = torch.tensor([video.video_grid_thw])
    kwargs: dict[str, Any] = {"pixel_values_videos": video.pixel_values_videos, "video_grid_thw": grid}
    if h.family == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([video.second_per_grid_t])  # float32, as the processor's
    if h.family not in QWEN3:
        merge = h.model.config.vision_config.spatial_merge_size
        return kwargs, "<|video_pad|>" * (int(np.prod(video.video_grid_thw)) // merge**2)
    proc = vision.processor  # Qwen3VLProcessor.replace_video_token itself, on a stand-in for its video processor
    stub = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=vision.video_settings.merge_size,
                                        temporal_patch_size=vision.video_settings.temporal_patch_size),
        vision_start_token=proc.vision_start_token, vision_end_token=proc.vision_end_token,
        video_token=proc.video_token, _calculate_timestamps=proc._calculate_timestamps)
    metadata = SimpleNamespace(fps=SOURCE_FPS, frames_indices=list(INDICES[: len(frames)]))
    return kwargs, type(proc).replace_video_token(stub, {**kwargs, "video_metadata": [metadata]}, 0)


def reference(h: Halves, text: str, frames: list[Image.Image],
              image: Image.Image | None = None) -> tuple[list[int], Any]:
    """model.generate() on the prompt as the processor expands it and the inputs the processor would give; also
    the input ids and kwargs (for get_rope_index)."""
    lm = h.lm
    kwargs, replacement = reference_video(h, frames)
    text = text.replace("<|video_pad|>", replacement, 1)
    if image is not None:
        out = h.vision.processor(text=[image_text(h.family)], images=[image], return_tensors="pt")
        kwargs.update({k: out[k] for k in ("pixel_values", "image_grid_thw", "image_sizes", "batch_num_images")
                       if k in out})
        text = text.replace(image_text(h.family), str(lm.tokenizer.decode(out["input_ids"][0])), 1)
    ids = torch.tensor([token_ids(lm, text)])
    assert lm.video_token_id is not None
    if h.family in QWEN:
        kwargs["mm_token_type_ids"] = ids.eq(lm.image_token_id).int() + 2 * ids.eq(lm.video_token_id).int()
    cfg = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = h.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **kwargs)
    assert out.shape[1] == ids.shape[1] + NUM_NEW
    return out[0, ids.shape[1] :].tolist(), (ids, kwargs)


def greedy(lm: LanguageHalf, ids: list[int], items: list[ImageFeatures]) -> tuple[list[int], Any]:
    prompt = build_prompt(lm, ids, items)
    return list(generate(lm, prompt, lambda logits: int(torch.argmax(logits)), NUM_NEW, eos_ids=set())), prompt


@pytest.mark.parametrize("family", FAMILIES)
def test_split_video_path_matches_generate(halves: dict[str, Halves], family: str) -> None:
    h = halves[family]
    frames = frames5()
    [feat] = through_connector([encode_video(h, frames)])
    ours, prompt = greedy(h.lm, token_ids(h.lm, chat(video_text(family))), [feat])
    want, (ids, kwargs) = reference(h, chat(video_text(family)), frames)
    assert prompt.input_ids.tolist() == ids.tolist()  # the span (Qwen3-VL: time stamps and groups) is transformers'
    assert ours == want
    assert len(set(ours)) > 1, "degenerate random model: the comparison would prove little"
    with torch.no_grad():
        if family in QWEN:
            rows = h.model.model.get_video_features(kwargs["pixel_values_videos"], kwargs["video_grid_thw"])
        else:
            rows = h.model.model.get_video_features(kwargs["pixel_values_videos"])
    assert torch.equal(feat.embeds, rows.pooler_output[0])
    assert feat.second_per_grid_t == pytest.approx((2 if family in QWEN else 1) / FPS)  # carried on the wire
    if family in QWEN3:
        assert feat.deepstack is not None
        assert torch.equal(feat.deepstack, torch.stack([d[0] for d in rows.deepstack_features]))
    if family not in QWEN:
        assert feat.grid_thw is None and feat.span is None
        return
    assert feat.grid_thw == tuple(kwargs["video_grid_thw"][0].tolist())
    positions, delta = h.lm.position_ids(prompt.input_ids, [feat])
    ref_positions, ref_delta = h.model.model.get_rope_index(
        ids, kwargs["mm_token_type_ids"], video_grid_thw=kwargs["video_grid_thw"],
        second_per_grid_ts=kwargs.get("second_per_grid_ts"))
    assert torch.equal(positions, ref_positions) and delta == int(ref_delta)


def test_qwen_video_temporal_positions(halves: dict[str, Halves]) -> None:
    """Qwen2-VL steps temporal patches by 1, Qwen2.5-VL by tokens_per_second * second_per_grid_t (truncated), and
    Qwen3-VL not at all (each patch is its own group after its time stamp)."""
    for family, steps in [("qwen2_vl", [0, 1, 2]), ("qwen2_5_vl", [0, 2, 5])]:
        h = halves[family]
        feat = encode_video(h, frames5())
        prompt = build_prompt(h.lm, token_ids(h.lm, chat(video_text(family))), [feat])
        positions, _ = h.lm.position_ids(prompt.input_ids, [feat])
        start = prompt.input_ids[0].tolist().index(h.lm.video_token_id)
        assert positions[0, 0, start : start + feat.num_tokens].unique().tolist() == [start + k for k in steps]
    for family in QWEN3:
        h = halves[family]
        feat = encode_video(h, frames5())
        prompt = build_prompt(h.lm, token_ids(h.lm, chat(video_text(family))), [feat])
        positions, _ = h.lm.position_ids(prompt.input_ids, [feat])
        ids = prompt.input_ids[0]
        starts = [i for i in range(len(ids)) if ids[i] == h.lm.video_token_id and ids[i - 1] != h.lm.video_token_id]
        assert len(starts) == 3  # one group per temporal patch, each at its own text position on every axis
        for s in starts:
            assert positions[0, 0, s : s + feat.num_tokens // 3].unique().tolist() == [int(positions[1, 0, s])]


@pytest.mark.parametrize("family", FAMILIES)
def test_video_and_image_in_one_prompt(halves: dict[str, Halves], family: str) -> None:
    h = halves[family]
    frames, image = frames5()[:4], make_image(112, 168, "orange")
    items = through_connector([h.vision.encode([image])[0], encode_video(h, frames)])
    text = chat(image_text(family) + "and" + video_text(family))
    ours, _ = greedy(h.lm, token_ids(h.lm, text), items)
    assert ours == reference(h, text, frames, image)[0]
    assert len(set(ours)) > 1
    with pytest.raises(ValueError, match="another order"):
        build_prompt(h.lm, token_ids(h.lm, text), items[::-1])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
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


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_alternating_frames_land_in_their_temporal_slots(halves: dict[str, Halves], family: str) -> None:
    """Frames A, B, A (padded with a repeat of the last: A): patch 0 holds (A, B), patch 1 holds (A, A)."""
    vision = halves[family].vision
    a, b = make_image(112, 112, "red"), make_image(112, 112, "blue", "square")
    video = video_inputs(vision.image_processor, vision.video_settings, [a, b, a], FPS)
    p, t = vision.video_settings.patch_size, vision.video_settings.temporal_patch_size
    slots = video.pixel_values_videos.view(2, -1, 3, t, p, p)  # (grid_t, N, C, T, p, p)

    def frame(im: Image.Image) -> torch.Tensor:  # its patches (N, C, p, p): the image path repeats them T times
        out = at_size(vision.image_processor, [im], video.video_grid_thw, p)
        return out["pixel_values"].view(-1, 3, t, p, p)[:, :, 0]

    assert not torch.equal(frame(a), frame(b))
    for (patch, slot), im in zip([(0, 0), (0, 1), (1, 0), (1, 1)], [a, b, a, a], strict=True):
        assert torch.equal(slots[patch, :, :, slot], frame(im))


def at_size(ip: Any, images: list[Image.Image], grid: tuple[int, int, int], patch: int, **kwargs: Any) -> Any:
    """The image path on images resized (its own PIL resample) to a video's frame size (Qwen3-VL's video size rule
    is not the image's, so the image processor is not asked to find it)."""
    size = (grid[2] * patch, grid[1] * patch)
    out = ip(images=[im.resize(size, ip.resample) for im in images], do_resize=False, return_tensors="pt", **kwargs)
    assert out["image_grid_thw"][0, 1:].tolist() == list(grid[1:])
    return out


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


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_patches_equal_transformers_patchify(halves: dict[str, Halves], family: str) -> None:
    """Our temporal regrouping of the image path's frames == the video processor's own patchify (padding
    included) on the same normalised frames (Qwen3VLVideoProcessor.patchify is the same code)."""
    vision = halves[family].vision
    ip, settings = vision.image_processor, vision.video_settings
    frames = [make_image(168, 112, c) for c in ("red", "blue", "green")]
    video = video_inputs(ip, settings, frames, FPS)
    p, m = settings.patch_size, settings.merge_size
    _, gh, gw = video.video_grid_thw
    single = at_size(ip, frames, video.video_grid_thw, p, temporal_patch_size=1)  # each frame's (C, p, p) rows
    # back to (F, C, H, W): rows are (gh/m, gw/m, m, m) x (C, p, p), as the image processor's patchify wrote them
    stack = single["pixel_values"].view(3, gh // m, gw // m, m, m, 3, p, p).permute(0, 5, 1, 3, 6, 2, 4, 7)
    stack = stack.reshape(1, 3, 3, gh * p, gw * p)
    patches, grid_t, grid_h, grid_w = _transformers_patchify()(None, stack, p, m, settings.temporal_patch_size)
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
    assert (settings.min_pixels, settings.max_pixels) == (1568, 3136)
    assert dict(settings.overrides) == {"image_mean": [0.5] * 3}
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
