"""LLaVA-OneVision's own video rules on frames where the answer is known by construction: a frame's pixels are the
image path's base tile of the same picture, a still video is its frame's rows repeated, alternating frames give
alternating rows, and one newline row ends the video (tests/models/test_video_parity.py compares the whole path
with generate())."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from epd_models.video import VideoClip, video_settings
from epd_models.video_onevision import frame_pixels
from tests.factories import make_image
from tests.models.test_video_parity import FPS, Halves

FAMILY = "llava_onevision"
PER_FRAME = 4  # the tiny tower's 4x4 patches pooled 2x2


@pytest.fixture(scope="module")
def h(tiny_model_dirs: dict[str, Path]) -> Halves:
    return Halves(FAMILY, tiny_model_dirs[FAMILY])


def blocks(rows: torch.Tensor, num_frames: int) -> list[torch.Tensor]:
    assert rows.shape[0] == num_frames * PER_FRAME + 1
    return list(rows[:-1].split(PER_FRAME))


def test_frame_pixels_are_the_images_base_tile(h: Halves) -> None:
    """The image path's first tile is the whole picture resized to the tile size: the frame's pixels exactly."""
    vision = h.vision
    for frame in (make_image(168, 112, "green", "triangle"), make_image(50, 90, "blue", "square")):
        tile = vision.image_processor(images=[frame], return_tensors="pt")["pixel_values"][0, 0]
        pixels = frame_pixels(vision.image_processor, vision.video_settings, VideoClip([frame], FPS))
        assert torch.equal(pixels[0], tile)


def test_still_video_is_its_frame_repeated_then_one_newline(h: Halves) -> None:
    vision = h.vision
    frame = make_image(168, 112, "green", "triangle")
    still, alone = vision.encode_video([frame] * 3, FPS), vision.encode_video([frame], FPS)
    assert all(torch.equal(b, blocks(alone.embeds, 1)[0]) for b in blocks(still.embeds, 3))
    newline = vision.module.get_parameter("image_newline").detach()
    assert torch.equal(still.embeds[-1], newline) and torch.equal(alone.embeds[-1], newline)


def test_alternating_frames_give_alternating_rows(h: Halves) -> None:
    vision = h.vision
    a, b = make_image(112, 112, "red"), make_image(112, 112, "blue", "square")
    [ra] = blocks(vision.encode_video([a], FPS).embeds, 1)
    [rb] = blocks(vision.encode_video([b], FPS).embeds, 1)
    assert not torch.equal(ra, rb)
    got = blocks(vision.encode_video([a, b, a, b], FPS).embeds, 4)
    assert all(torch.equal(g, want) for g, want in zip(got, [ra, rb, ra, rb], strict=True))


def test_only_the_last_chunk_has_the_newline(h: Halves) -> None:
    vision = h.vision
    frames: list[Image.Image] = [make_image(112, 112, c) for c in ("red", "green", "blue")]
    first = vision.encode_video(frames[:2], FPS, last=False, total_frames=3)
    last = vision.encode_video(frames[2:], FPS, total_frames=3)
    assert (first.num_tokens, last.num_tokens) == (2 * PER_FRAME, PER_FRAME + 1)
    assert first.is_video and first.grid_thw is None and first.span is None


def test_settings_come_from_the_video_processor_config(tmp_path: Path, h: Halves) -> None:
    vision = h.vision
    ip = vision.image_processor
    assert video_settings(tmp_path, ip, FAMILY).frame_size == (32, 32)  # none: the image processor's tile size
    config = {"size": {"height": 64, "width": 64}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(config))
    settings = video_settings(tmp_path, ip, FAMILY)
    assert settings.frame_size == (64, 64) and dict(settings.overrides) == {"image_mean": [0.5] * 3,
                                                                            "image_std": [0.5] * 3}
    assert (settings.temporal_patch_size, settings.min_pixels, settings.max_pixels) == (1, 64 * 64, 64 * 64)
    with pytest.raises(ValueError, match="vision tower"):  # frames the tower cannot take
        vision.adapter.encode_video(vision.module, vision.processor, vision.config, settings,
                                    VideoClip([make_image(64, 64)], FPS))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 64}}))
    with pytest.raises(ValueError, match="height and width"):
        video_settings(tmp_path, ip, FAMILY)
