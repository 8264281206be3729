"""The random multimodal dataset: seeded, repeats are byte-identical, warm-ups never overlap the measured set."""
from __future__ import annotations

import base64
import io
from dataclasses import replace

import pytest
from PIL import Image

from epd_bench.dataset import DatasetSpec, build_dataset, repeat_share

SPEC = DatasetSpec(num_prompts=200, input_len=10, output_len=8, images_per_request=2, image_width=16,
                   image_height=8, repeat_ratio=0.5, seed=3)


def test_same_seed_same_dataset_other_seed_other_dataset() -> None:
    small = replace(SPEC, num_prompts=5)
    assert build_dataset(small, 2) == build_dataset(small, 2)
    other = build_dataset(replace(small, seed=4), 2)[1]
    assert [r.prompt for r in other] != [r.prompt for r in build_dataset(small)[1]]
    assert other[0].images[0] != build_dataset(small)[1][0].images[0]


def test_repeat_ratio_sets_the_share_of_repeated_images() -> None:
    _, requests = build_dataset(SPEC)
    assert repeat_share(requests) == pytest.approx(0.5, abs=0.07)
    by_id: dict[int, str] = {}
    for r in requests:
        assert len(set(r.image_ids)) == len(r.image_ids)  # never the same image twice in one request
        for i, url in zip(r.image_ids, r.images, strict=True):
            assert by_id.setdefault(i, url) == url  # a repeat is the very same bytes
    assert len(set(by_id.values())) == len(by_id)  # distinct images differ


def test_no_repeats_and_text_only() -> None:
    assert repeat_share(build_dataset(replace(SPEC, num_prompts=20, repeat_ratio=0.0))[1]) == 0.0
    text = build_dataset(replace(SPEC, num_prompts=3, images_per_request=0))[1]
    assert all(r.images == () for r in text) and repeat_share(text) == 0.0


def test_warmups_use_images_the_measured_requests_never_send() -> None:
    warm, requests = build_dataset(replace(SPEC, num_prompts=30), num_warmups=3)
    assert len(warm) == 3 and len(requests) == 30
    assert not {u for r in warm for u in r.images} & {u for r in requests for u in r.images}


def test_images_and_lengths_follow_the_spec() -> None:
    _, requests = build_dataset(replace(SPEC, num_prompts=50, range_ratio=0.5, image_format="png"))
    header, data = requests[0].images[0].split(",", 1)
    assert header == "data:image/png;base64"
    assert Image.open(io.BytesIO(base64.b64decode(data))).size == (16, 8)
    words = [len(r.prompt.split()) for r in requests]
    assert min(words) >= 5 and max(words) <= 15 and len(set(words)) > 3
    assert all(4 <= r.output_len <= 12 for r in requests)
