"""LLaVA-OneVision: an image of a multi-image prompt is its base tile only, so the encoder is told (`multi_image`),
the flag is part of the image's mm_hash everywhere it is computed, the proxy sets it only for this family and only
when the prompt has several images, and a decoder refuses images encoded for the other case."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch

from decoder_service.request import Preparer
from epd_common.errors import APIError
from epd_contracts.generate import GenerateRequest, ImageRef
from epd_contracts.hashing import mm_hash, multi_image_item
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf, VisionHalf
from proxy.config import ProxyConfig
from proxy.prepare import prepare_chat
from proxy.protocol import ChatCompletionRequest
from tests.factories import make_image


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    make_image(width, height).save(buf, format="PNG")
    return buf.getvalue()


def test_the_flag_is_part_of_the_hash_and_only_this_family_uses_it() -> None:
    data = _png(32, 32)
    assert mm_hash(data, multi_image=True) != mm_hash(data) and mm_hash(data, "low", True) != mm_hash(data, "low")
    assert multi_image_item("llava_onevision", 2) and not multi_image_item("llava_onevision", 1)
    assert not any(multi_image_item(f, 2) for f in ("llava", "llava_next", "qwen2_vl", None))


def test_a_multi_image_item_is_the_base_tile_and_the_others_are_not(tiny_model_dirs: dict[str, Path]) -> None:
    vision = VisionHalf(tiny_model_dirs["llava_onevision"])
    images = [make_image(224, 224), make_image(168, 112)]
    alone, several = vision.encode(images), vision.encode(images, multi_image=True)
    base = vision.processor.num_image_tokens + 1  # the base tile and its newline
    assert [f.num_tokens for f in several] == [base, base]
    assert all(a.num_tokens > base for a in alone) and alone[0].num_tokens != alone[1].num_tokens
    assert not torch.equal(several[0].embeds, alone[0].embeds[:base])


@pytest.mark.parametrize("family,num_images,multi", [("llava_onevision", 2, True), ("llava_onevision", 1, False),
                                                      ("llava_next", 2, False), (None, 2, False)])
def test_the_proxy_sets_the_flag_and_hashes_with_it(family: str | None, num_images: int, multi: bool) -> None:
    data = _png(48, 32)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(num_images)]
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": [{"role": "user", "content": parts}]})
    prepared = prepare_chat(req, ProxyConfig(encode_urls=("http://e",), decode_urls=("http://d",)), family=family)
    assert [(it.multi_image, it.mm_hash) for it in prepared.items] == [(multi, mm_hash(data, multi_image=multi))] * num_images


@pytest.mark.parametrize("flags", [(False, False), (True, False), (True,)])
def test_a_decoder_refuses_images_encoded_for_the_other_case(tiny_model_dirs: dict[str, Path],
                                                             flags: tuple[bool, ...]) -> None:
    lm = LanguageHalf(tiny_model_dirs["llava_onevision"])
    preparer = Preparer(lm, 256, lm.module.lm_head.out_features, 4, set())
    parts = [{"type": "image"} for _ in flags]
    req = GenerateRequest(messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
                          images=[ImageRef(mm_hash=f"h{i}", source="tcp://127.0.0.1:1", multi_image=f)
                                  for i, f in enumerate(flags)],
                          sampling=SamplingParams(max_tokens=4))

    def gather(_: GenerateRequest) -> list:
        raise AssertionError("refused before the gather")

    with pytest.raises(APIError) as err:
        preparer.prepare(req, gather)
    bad = next(i for i, f in enumerate(flags) if f != (len(flags) > 1))
    assert err.value.status == 400 and err.value.param == f"images.{bad}.multi_image"
