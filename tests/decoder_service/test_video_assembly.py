"""A video's chunks made into one item (decoder_service/video_gather.py), the checks a video's embeddings pass
(decoder_service/embedding_check.py) and its tokens in the prefix cache's keys (decoder_service/engine/prefix_hash.py),
on made-up features: each inconsistency is a clear error."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from decoder_service.embedding_check import EmbeddingCheck
from decoder_service.engine.prefix_hash import prompt_chain
from decoder_service.request import Preparer
from decoder_service.video_gather import Gathered, assemble_video, plan_gather
from epd_common.errors import APIError
from epd_common.video_sampling import VideoConfig
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.generate import ChunkRef, GenerateRequest, ImageRef
from epd_contracts.video import VideoPart, VideoSampling
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import make_image

CONFIG = VideoConfig(sampler="qwen2", temporal_patch=2, min_pixels=784, max_pixels=50176)
SAMPLING = VideoSampling(num_frames=8, fps=2.0, max_pixels=50176)
PART = VideoPart(sampling=SAMPLING, count=8, total=8)  # 8 frames: 4 temporal patches
WIDTH = 64


def chunk(t: int, rows_per_patch: int = 6, hw: tuple[int, int] = (4, 6), spg: float | None = 1.0,
          span: tuple[int, ...] | None = None, deep: bool = False, start: float = 0.0) -> ImageFeatures:
    n = t * rows_per_patch
    embeds = torch.arange(n * WIDTH, dtype=torch.float32).view(n, WIDTH) + start
    return ImageFeatures(embeds=embeds, grid_thw=(t, *hw), span=span, second_per_grid_t=spg,
                         deepstack=torch.full((2, n, WIDTH), start) if deep else None)


def refs(num_chunks: int, **kw: object) -> ImageRef:
    chunks = [ChunkRef(mm_hash=f"c{k}", source="tcp://e", **kw) for k in range(num_chunks)]  # type: ignore[arg-type]
    return ImageRef(mm_hash="v", video=PART, chunks=chunks)


def test_chunks_become_one_video() -> None:
    a, b = chunk(2, span=(1, 9, 9), deep=True), chunk(2, span=(2, 9), deep=True, start=0.5)
    video = assemble_video(0, [a, b], 4)
    assert video.grid_thw == (4, 4, 6) and video.second_per_grid_t == 1.0 and video.num_tokens == 24
    assert torch.equal(video.embeds, torch.cat([a.embeds, b.embeds])) and video.span == (1, 9, 9, 2, 9)
    assert video.deepstack is not None and torch.equal(video.deepstack, torch.cat([a.deepstack, b.deepstack], 1))  # type: ignore[list-item]
    plain = assemble_video(0, [chunk(3), chunk(1)], 4)
    assert plain.span is None and plain.deepstack is None
    no_grid = ImageFeatures(embeds=torch.zeros(5, WIDTH), second_per_grid_t=1.0)  # OneVision: no grid
    assert assemble_video(0, [no_grid, no_grid], 4).grid_thw is None


@pytest.mark.parametrize(("chunks", "why"), [
    ([chunk(2), chunk(2, spg=None)], "chunk 1 is not a video"),
    ([chunk(2), chunk(2, hw=(6, 4))], "frames of different sizes"),
    ([chunk(2), chunk(2, spg=0.5)], "seconds per temporal patch"),
    ([chunk(2), chunk(1)], "hold 3 temporal patches; its frames make 4"),
    ([chunk(2, span=(9,)), chunk(2)], "some of its chunks have a span"),
    ([chunk(2, deep=True), chunk(2)], "DeepStack"),
])
def test_chunks_that_do_not_fit_together_are_a_502(chunks: list[ImageFeatures], why: str) -> None:
    with pytest.raises(APIError) as err:
        assemble_video(3, chunks, 4)
    assert (err.value.status, err.value.code, err.value.param) == (502, "invalid_embeddings", "images.3")
    assert why in err.value.message


def test_the_plan_gathers_every_chunk_with_the_images() -> None:
    image = ImageRef(mm_hash="i", source="tcp://a", pending=True)
    video = refs(3)
    whole = ImageRef(mm_hash="w", source="tcp://b", video=PART)
    plan = plan_gather([image, video, whole], CONFIG, takes_video=True)
    assert plan.hashes == ["i", "c0", "c1", "c2", "w"] and plan.pending == ["i"]
    assert plan.sources == {"i": "tcp://a", "c0": "tcp://e", "c1": "tcp://e", "c2": "tcp://e", "w": "tcp://b"}
    got = {"i": ImageFeatures(torch.zeros(4, WIDTH), (1, 4, 4)), "c0": chunk(2), "c1": chunk(1), "c2": chunk(1),
           "w": chunk(4)}
    out = plan.assemble(got, temporal_patch=2)
    assert [g.features.num_tokens for g in out] == [4, 24, 24] and out[1].features.grid_thw == (4, 4, 6)
    assert all(g.held == () for g in out)
    held = plan_gather([refs(3, cached=True)], CONFIG, True).assemble(got, 2)
    assert held == [Gathered(held[0].features, ((0, 12), (12, 18), (18, 24)))]
    with pytest.raises(APIError, match="is an image, but its embeddings are a video's") as err:
        plan_gather([ImageRef(mm_hash="c0")], CONFIG, True).assemble(got, 2)
    assert err.value.status == 502


@pytest.mark.parametrize(("images", "config", "takes_video", "code", "param"), [
    ([refs(2)], None, False, "video_not_supported", "images.0"),
    ([ImageRef(mm_hash="v", video=PART)], CONFIG, False, "video_not_supported", "images.0"),
    ([ImageRef(mm_hash="i"), refs(5)], CONFIG, True, "too_many_chunks", "images.1.chunks"),  # 8 frames: 4 patches
    ([ImageRef(mm_hash="v", video=PART, chunks=[ChunkRef(mm_hash="c"), ChunkRef(mm_hash="c")])], CONFIG, True,
     "invalid_value", "images.0.chunks"),
])
def test_what_a_request_cannot_have_is_a_400_before_any_gather(images: list[ImageRef], config: VideoConfig | None,
                                                               takes_video: bool, code: str, param: str) -> None:
    with pytest.raises(APIError) as err:
        plan_gather(images, config, takes_video)
    assert (err.value.status, err.value.code, err.value.param) == (400, code, param)


@pytest.fixture(scope="module")
def qwen(tiny_model_dirs: dict[str, Path]) -> tuple[EmbeddingCheck, LanguageHalf]:
    lm = LanguageHalf(tiny_model_dirs["qwen2_vl"])
    return EmbeddingCheck(lm), lm


def test_a_video_span_holds_only_video_tokens_markup_and_time_stamps(qwen: tuple[EmbeddingCheck, LanguageHalf]) -> None:
    check, lm = qwen
    tok, video = lm.tokenizer, lm.video_token_id
    start, end = lm.config.vision_start_token_id, lm.config.vision_end_token_id

    def stamp(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def group(text: str, n: int = 6, token: int | None = video) -> list[int]:
        return [*stamp(text), start, *[token] * n, end]

    def features(span: list[int]) -> ImageFeatures:
        return ImageFeatures(torch.zeros(12, WIDTH), (2, 4, 6), span=tuple(span), second_per_grid_t=1.0)

    assert check(features(group("<0.5 seconds>") + group("<12.0 seconds>"))) is None
    assert check(ImageFeatures(torch.zeros(12, WIDTH), (2, 4, 6), second_per_grid_t=1.0)) is None  # no span
    for span, why in [(group("<0.5 seconds>") + group("Hello"), "video layout"),
                      (group("<0.5 seconds>") + group("<1.0 seconds>", token=lm.image_token_id), "video tokens"),
                      (group("<0.5 seconds>", n=5) + group("<1.0 seconds>", n=6), "video tokens"),
                      (group("<0.5 seconds>") + [lm.image_token_id] + group("<1.0 seconds>"), "video layout"),
                      (group("<0.5 seconds>") + [10**9] + group("<1.0 seconds>"), "video layout")]:
        reason = check(features(span))
        assert reason is not None and why in reason, span
    image_with_video_tokens = ImageFeatures(torch.zeros(12, WIDTH), (1, 4, 12), span=tuple(group("", n=12)))
    assert "not this model's image layout" in str(check(image_with_video_tokens))


def test_a_video_for_a_model_without_video_is_refused(tiny_model_dirs: dict[str, Path]) -> None:
    check = EmbeddingCheck(LanguageHalf(tiny_model_dirs["llava"]))
    reason = check(ImageFeatures(torch.zeros(256, WIDTH), second_per_grid_t=1.0))
    assert reason is not None and "takes no video" in reason


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision"])
def test_each_familys_video_chunks_pass_its_check(tiny_model_dirs: dict[str, Path], family: str) -> None:
    """A middle chunk and a last chunk of real video features (time stamps and DeepStack rows for Qwen3-VL)."""
    vision, lm = VisionHalf(tiny_model_dirs[family]), LanguageHalf(tiny_model_dirs[family])
    check = EmbeddingCheck(lm)
    frames = [make_image(96, 64, c) for c in ("red", "green", "blue", "red", "green")]
    middle = vision.encode_video(frames[:2], 2.0, frame_times=[1.0, 1.5], last=False, total_frames=5)
    last = vision.encode_video(frames[2:], 2.0, frame_times=[2.0, 2.5, 3.0], last=True, total_frames=5)
    assert check(middle) is None and check(last) is None


def test_video_tokens_are_named_by_the_videos_hash_in_the_prefix_keys() -> None:
    img, vid, b = 99, 98, 4
    ids = [1, 2, 3, 4, img, img, vid, vid, vid, vid, 5, 6, 7]  # blocks [1..4] [I I V V] [V V 5 6] + tail [7]
    one = prompt_chain(ids, b, "", img, [("pic", 2), ("video-1", 4)], video_token_id=vid)
    two = prompt_chain(ids, b, "", img, [("pic", 2), ("video-2", 4)], video_token_id=vid)
    assert one is not None and two is not None and len(one.keys) == 3
    assert one.keys[0] == two.keys[0] and one.keys[1] != two.keys[1] and one.keys[2] != two.keys[2]
    assert prompt_chain(ids, b, "", img, [("pic", 2), ("video-1", 4)]) is None  # video rows not counted: not cached


def test_a_video_does_not_make_a_onevision_image_one_of_several(tiny_model_dirs: dict[str, Path]) -> None:
    """LLaVA-OneVision's processor counts the images of a prompt, not its videos: one image beside a video is
    encoded alone (multi_image false), and the check before the gather says so."""
    lm = LanguageHalf(tiny_model_dirs["llava_onevision"])
    preparer = Preparer(lm, 256, lm.module.lm_head.out_features, 4, set())
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "hi"}]

    class ReachedGather(Exception):
        pass

    def gather(_: GenerateRequest) -> list[Any]:
        raise ReachedGather

    for multi, passes in ((False, True), (True, False)):
        req = GenerateRequest(messages=[{"role": "user", "content": content}],
                              images=[ImageRef(mm_hash="i", multi_image=multi), ImageRef(mm_hash="v", video=PART)])
        with pytest.raises(ReachedGather if passes else APIError):
            preparer.prepare(req, gather)
