"""A video encoded in chunks (frames [first, first + n) each, as several encoders do) is exactly the whole video's
encoding once the chunks are put back together the way the decoder does: rows concatenated, DeepStack features
concatenated on their token dim, spans concatenated, grid (sum of t, h, w); and the decoder's answer from the
chunks is the whole video's, token for token.

Why it can be exact: Qwen's vision towers attend within one temporal patch (cu_seqlens per grid_t) with rotary and
learned positions from (h, w) only, a chunk is whole temporal patches (only the last one padded, as the whole
video is), and every frame of a chunk has the whole video's size (Qwen3-VL's is set by the whole video's frame
count: total_frames); LLaVA-OneVision encodes and pools frame by frame and only the last chunk has the newline row.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from epd_contracts.embeddings import ImageFeatures
from epd_models.video import VideoError
from tests.factories import make_image, through_connector
from tests.models.test_video_parity import (
    FAMILIES,
    FPS,
    Halves,
    chat,
    encode_video,
    frame_times,
    greedy,
    reference,
    token_ids,
    video_text,
)

COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "white")


@pytest.fixture(scope="module")
def halves(tiny_model_dirs: dict[str, Path]) -> dict[str, Halves]:
    return {family: Halves(family, tiny_model_dirs[family]) for family in FAMILIES}


def frames(n: int) -> list[Image.Image]:
    return [make_image(168, 112, c, "square" if i % 2 else "circle") for i, c in enumerate(COLORS[:n])]


def encode_chunks(h: Halves, video: list[Image.Image], cuts: list[int]) -> list[ImageFeatures]:
    """The chunks [cuts[i], cuts[i + 1]) as encoders encode them: their frames, times, and the video's count."""
    times, n = frame_times(len(video)), len(video)
    return [h.vision.encode_video(video[a:b], FPS, frame_times=times[a:b], last=b == n, total_frames=n)
            for a, b in zip(cuts, cuts[1:], strict=False)]


def assemble(chunks: list[ImageFeatures]) -> ImageFeatures:
    """One video's item from its chunks, in order (what the decoder's gather does)."""
    grids = [c.grid_thw for c in chunks]
    grid = None
    if grids[0] is not None:
        assert all(g is not None and g[1:] == grids[0][1:] for g in grids)
        grid = (sum(g[0] for g in grids if g is not None), grids[0][1], grids[0][2])
    spans = [c.span for c in chunks]
    deep = [c.deepstack for c in chunks]
    assert len({c.second_per_grid_t for c in chunks}) == 1
    return ImageFeatures(
        embeds=torch.cat([c.embeds for c in chunks]), grid_thw=grid,
        span=None if spans[0] is None else tuple(t for s in spans if s is not None for t in s),
        deepstack=None if deep[0] is None else torch.cat([d for d in deep if d is not None], dim=1),
        second_per_grid_t=chunks[0].second_per_grid_t)


@pytest.mark.parametrize("num_frames", [6, 5])  # 5: the Qwen families pad the last chunk (its last frame repeated)
@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_put_together_are_the_whole_video(halves: dict[str, Halves], family: str, num_frames: int) -> None:
    h = halves[family]
    video = frames(num_frames)
    whole = encode_video(h, video)
    parts = through_connector(encode_chunks(h, video, [0, 2, num_frames]))
    if family == "llava_onevision":  # the newline row is the last chunk's only
        assert [p.num_tokens for p in parts] == [2 * 4, (num_frames - 2) * 4 + 1]
    joined = assemble(parts)
    # bit-equal: each chunk runs the same kernels over the same rows of each temporal patch / frame
    assert torch.equal(joined.embeds, whole.embeds)
    assert joined.grid_thw == whole.grid_thw and joined.span == whole.span
    assert joined.second_per_grid_t == whole.second_per_grid_t
    assert (joined.deepstack is None) == (whole.deepstack is None)
    if whole.deepstack is not None:
        assert joined.deepstack is not None and torch.equal(joined.deepstack, whole.deepstack)
    text = chat(video_text(family))
    ours, _ = greedy(h.lm, token_ids(h.lm, text), [joined])
    assert ours == reference(h, text, video)[0]  # == model.generate() on the whole video


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_three_chunks_of_one_patch_each(halves: dict[str, Halves], family: str) -> None:
    h = halves[family]
    video = frames(5)
    joined = assemble(encode_chunks(h, video, [0, 2, 4, 5]))
    whole = encode_video(h, video)
    assert torch.equal(joined.embeds, whole.embeds) and joined.span == whole.span


def test_a_chunk_is_whole_temporal_patches_unless_it_is_last(halves: dict[str, Halves]) -> None:
    vision = halves["qwen2_vl"].vision
    video = frames(5)
    with pytest.raises(VideoError, match="whole temporal patches"):
        vision.encode_video(video[:3], FPS, last=False, total_frames=5)
    with pytest.raises(VideoError, match="total_frames"):  # a chunk cannot be longer than its video, nor all of it
        vision.encode_video(video[:4], FPS, last=False, total_frames=4)


def test_a_qwen3_chunk_needs_the_videos_frame_count_and_times(halves: dict[str, Halves]) -> None:
    """Qwen3-VL sizes every frame by the whole video's frame count and writes the source times."""
    vision = halves["qwen3_vl"].vision
    video, times = frames(6), frame_times(6)
    with pytest.raises(ValueError, match="total_frames"):
        vision.encode_video(video[:2], FPS, frame_times=times[:2], last=False)
    with pytest.raises(VideoError, match="frame_times"):
        vision.encode_video(video[:2], FPS, last=False, total_frames=6)
    alone = vision.encode_video(video[:2], FPS, frame_times=times[:2])  # a 2-frame video: larger frames
    chunk = vision.encode_video(video[:2], FPS, frame_times=times[:2], last=False, total_frames=6)
    assert alone.grid_thw is not None and chunk.grid_thw is not None
    assert alone.grid_thw[1] * alone.grid_thw[2] > chunk.grid_thw[1] * chunk.grid_thw[2]
