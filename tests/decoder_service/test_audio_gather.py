"""An audio clip's chunks made into one item (decoder_service/video_gather.py), on made-up features: the rows in
chunk order, marked as audio, held ranges per chunk; what a decoder cannot take is a 400 before anything is
fetched, and embeddings that are not a clip's are the encoders' fault (502)."""
from __future__ import annotations

import pytest
import torch

from decoder_service.video_gather import plan_gather
from epd_common.errors import APIError
from epd_contracts.audio import AudioPart
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.generate import ChunkRef, ImageRef

CLIP = AudioPart(sample_rate=16_000, window=2.0)


def rows(n: int, start: float) -> ImageFeatures:
    return ImageFeatures(embeds=torch.full((n, 8), start))


def clip_ref(num_chunks: int, cached: tuple[int, ...] = ()) -> ImageRef:
    return ImageRef(mm_hash="clip", audio=CLIP, chunks=[ChunkRef(mm_hash=f"a{k}", source="tcp://e", cached=k in cached)
                                                        for k in range(num_chunks)])


def test_chunks_are_one_clip_in_order_with_their_held_rows() -> None:
    plan = plan_gather([ImageRef(mm_hash="pic"), clip_ref(3, cached=(1,))], None, False, takes_audio=True)
    assert plan.hashes == ["pic", "a0", "a1", "a2"]
    got = {"pic": rows(4, 9.0), "a0": rows(50, 0.0), "a1": rows(50, 1.0), "a2": rows(13, 2.0)}
    image, clip = plan.assemble(got)
    assert not image.features.audio and clip.features.audio and clip.features.num_tokens == 113
    assert torch.equal(clip.features.embeds[:, 0], torch.tensor([0.0] * 50 + [1.0] * 50 + [2.0] * 13))
    assert clip.held == ((50, 100),)
    [whole] = plan_gather([ImageRef(mm_hash="clip", audio=CLIP, cached=True)], None, False, True).assemble(
        {"clip": rows(7, 0.0)})
    assert whole.features.audio and whole.held == ((0, 7),)


def test_what_a_decoder_cannot_take_is_a_400_before_any_fetch() -> None:
    with pytest.raises(APIError) as err:
        plan_gather([clip_ref(2)], None, takes_video=True, takes_audio=False)
    assert (err.value.status, err.value.code, err.value.param) == (400, "audio_not_supported", "images.0")
    twice = ImageRef(mm_hash="clip", audio=CLIP, chunks=[ChunkRef(mm_hash="a0"), ChunkRef(mm_hash="a0")])
    with pytest.raises(APIError) as err:
        plan_gather([twice], None, False, True)
    assert (err.value.status, err.value.param) == (400, "images.0.chunks")


def test_embeddings_that_are_not_a_clips_are_the_encoders_fault() -> None:
    plan = plan_gather([clip_ref(2)], None, False, True)
    video = ImageFeatures(embeds=torch.zeros(4, 8), grid_thw=(1, 2, 2), second_per_grid_t=1.0)
    with pytest.raises(APIError) as err:
        plan.assemble({"a0": rows(3, 0.0), "a1": video})
    assert (err.value.status, err.value.code) == (502, "invalid_embeddings")


def test_rows_alone_under_an_images_hash_are_refused_where_images_have_a_grid() -> None:
    """A model that takes audio lets rows alone through its connector check (a clip's are rows alone); an image's ref
    that gets such rows in an M-RoPE family is the encoders' fault, not a crash in the positions."""
    plan = plan_gather([ImageRef(mm_hash="pic")], None, False, True)
    with pytest.raises(APIError) as err:
        plan.assemble({"pic": rows(4, 0.0)}, needs_grid=True)
    assert (err.value.status, err.value.code) == (502, "invalid_embeddings")
    assert not plan.assemble({"pic": rows(4, 0.0)})[0].features.audio  # a family without grids: an image's rows
