"""A decoder checks every embedding it receives against its own model before it caches or uses it."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from connector.tensors.producer import ECProducer
from decoder_service.embedding_check import EmbeddingCheck
from decoder_service.state import DecoderState
from epd_builders.tiny import TinySpec, build_tiny
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.hashing import mm_hash
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import make_image

LLAVA_TOKENS, WIDTH = 256, 64  # the tiny LLaVA: (224 / 14) ** 2 patches, CLS dropped; its LM's hidden size
ASK = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]}]
TEXT = [{"role": "user", "content": [{"type": "text", "text": "What color is the shape?"}]}]
SAMPLING = {"max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def llava_check(tiny_model_dirs: dict[str, Path]) -> EmbeddingCheck:
    return EmbeddingCheck(LanguageHalf(tiny_model_dirs["llava"]))


@pytest.fixture(scope="module")
def qwen_check(tiny_model_dirs: dict[str, Path]) -> EmbeddingCheck:
    return EmbeddingCheck(LanguageHalf(tiny_model_dirs["qwen2_vl"]))


def out(embeds: torch.Tensor, grid: tuple[int, int, int] | None = None) -> ImageFeatures:
    return ImageFeatures(embeds, grid)


def test_llava_embeddings_of_its_own_shape_pass(llava_check: EmbeddingCheck) -> None:
    assert llava_check(out(torch.zeros(LLAVA_TOKENS, WIDTH))) is None
    assert llava_check(out(torch.zeros(LLAVA_TOKENS, WIDTH, dtype=torch.bfloat16))) is None


@pytest.mark.parametrize(("embeds", "why"), [
    (torch.zeros(LLAVA_TOKENS, 32), "width 32"),
    (torch.zeros(64, WIDTH), "64 image tokens, but this model expects 256"),
    (torch.zeros(LLAVA_TOKENS, WIDTH, dtype=torch.int64), "floating"),
    (torch.zeros(1, LLAVA_TOKENS, WIDTH), "2-D"),
    (torch.full((LLAVA_TOKENS, WIDTH), float("nan")), "non-finite"),
])
def test_llava_refuses_what_its_lm_cannot_use(llava_check: EmbeddingCheck, embeds: torch.Tensor, why: str) -> None:
    reason = llava_check(out(embeds))
    assert reason is not None and why in reason


def test_qwen_counts_tokens_from_the_grid_and_merge_size(qwen_check: EmbeddingCheck) -> None:
    assert qwen_check.merge == 2
    assert qwen_check(out(torch.zeros(16, WIDTH), (1, 8, 8))) is None  # 1 * 8 * 8 / 2**2
    assert "expects 16" in (qwen_check(out(torch.zeros(15, WIDTH), (1, 8, 8))) or "")
    assert "missing" in (qwen_check(out(torch.zeros(16, WIDTH))) or "")
    assert "divisible" in (qwen_check(out(torch.zeros(16, WIDTH), (1, 7, 9))) or "")
    assert "not positive" in (qwen_check(out(torch.zeros(16, WIDTH), (0, 8, 8))) or "")


@pytest.fixture(scope="module")
def foreign_producer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ECProducer, str]]:
    """An encoder of another tiny LLaVA (LM width 32, 112-pixel tower: 64 image tokens) holding one image."""
    model = build_tiny(TinySpec(family="llava", text_hidden=32, image_size=112), tmp_path_factory.mktemp("other"))
    feats = VisionHalf(model).encode([make_image(112, 112)])[0]
    assert tuple(feats.embeds.shape) == (64, 32)
    producer = ECProducer().start()
    key = mm_hash(b"an image of the other model")
    producer.save_caches(key, ImageFeatures(feats.embeds))
    yield producer, key
    producer.close()


def test_an_encoder_of_another_model_gets_its_request_refused_and_nothing_is_cached(
        decoder: tuple[str, DecoderState], foreign_producer: tuple[ECProducer, str]) -> None:
    url, ref = decoder
    producer, key = foreign_producer
    images = [{"mm_hash": key, "source": producer.address}]
    resp = httpx.post(f"{url}/generate", json={"messages": ASK, "images": images, "sampling": SAMPLING}, timeout=30)
    error = resp.json()["error"]
    assert resp.status_code == 502 and error["code"] == "invalid_embeddings" and error["param"] == "images"
    assert key in error["message"] and "width 32" in error["refused"][key]
    assert not ref.engine.consumer.has_cache_item(key)
    done = httpx.post(f"{url}/generate", json={"messages": TEXT, "sampling": SAMPLING}, timeout=30).text.splitlines()
    assert json.loads(done[-1])["type"] == "done"  # the decoder keeps serving
