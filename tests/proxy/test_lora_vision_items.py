"""A request under an adapter whose weights reach the vision tower (a decoder's /health says `vision`): the proxy
sends its images to the encoders under the adapter and keys them by epd_contracts.hashing.adapter_hash (so they are
cached apart from the base model's and every other adapter's), names their fields by the new keys, and refuses
videos and audio under it (the encoders apply it to images only)."""
from __future__ import annotations

import dataclasses

import httpx
import pytest

from epd_common.errors import APIError
from epd_contracts.hashing import adapter_hash
from proxy.prepare import prepare_chat, under_vision_adapter
from proxy.workers import Workers
from tests.proxy.test_prepare import CFG, data_url, request


def test_images_are_encoded_under_the_adapter_and_keyed_apart() -> None:
    a, b = data_url("PNG"), data_url("JPEG", 40)
    chat = prepare_chat(request(a, b, a), CFG)
    under = under_vision_adapter(chat, "v")
    assert [it.mm_hash for it in under.items] == [adapter_hash(it.mm_hash, "v") for it in chat.items]
    assert {c.lora for c in under.encodes} == {"v"} and under.lora == "v"
    assert under.params == {adapter_hash(h, "v"): p for h, p in chat.params.items()}
    assert under_vision_adapter(chat, "w").items[0].mm_hash not in {it.mm_hash for it in under.items}
    assert [it.data for it in under.items] == [it.data for it in chat.items]
    with pytest.raises(APIError) as refused:  # anything but an image (a video, an audio clip) under it
        under_vision_adapter(dataclasses.replace(chat, items=[*chat.items, object()]), "v")  # type: ignore[list-item]
    assert refused.value.status == 400 and refused.value.code == "unsupported_lora_media"


def test_the_vision_adapters_are_those_a_healthy_decoder_marks() -> None:
    workers = Workers(httpx.AsyncClient(), 60.0, 1.0, 3, lambda w: None, lambda w: None)
    w = workers.add("decoder", "http://d")
    w.healthy, w.info = True, {"loras": [{"name": "v", "vision": True}, {"name": "lm", "vision": False}, "junk"]}
    assert workers.vision_loras() == {"v"} and set(workers.loras()) == {"v", "lm"}
    w.healthy = False
    assert workers.vision_loras() == set()
