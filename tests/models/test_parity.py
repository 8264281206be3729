"""The split path (vision half -> connector wire -> language half) equals model.generate() token for token.

Both run on --device (default cpu; `python -m epd_bench.gpu_check` runs them on cuda)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from decoder_service.embedding_check import EmbeddingCheck
from decoder_service.generate import generate
from decoder_service.prompt import build_prompt
from epd_builders.tiny import FAMILIES
from epd_contracts.embeddings import ImageFeatures
from epd_models.chat import chat_template, render
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import make_image

NUM_NEW = 16
CASES = {
    "text_only": [],
    "one_image": [(224, 224, "red")],
    "two_images_of_different_sizes": [(224, 224, "red"), (168, 112, "blue")],
}


def _messages(num_images: int) -> list[dict]:
    parts: list[dict] = [{"type": "image"} for _ in range(num_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What color is the shape?"}]}]


def _reference(model_dir: Path, prompt_text: str, images: list, device: str) -> list[int]:
    proc = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval().to(device)
    inputs = proc(text=[prompt_text], images=images or None, return_tensors="pt").to(device)
    cfg = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(**inputs, generation_config=cfg)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _through_connector(features: list[ImageFeatures]) -> list[ImageFeatures]:
    producer, consumer = ECProducer(), ECConsumer()
    producer.start()
    try:
        hashes = [f"h{i}" for i in range(len(features))]
        for h, f in zip(hashes, features, strict=True):
            producer.save_caches(h, f)
        got = consumer.gather(hashes, {h: producer.address for h in hashes}, timeout=5.0)
        return [got[h] for h in hashes]
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_split_path_matches_generate(tiny_model_dirs: dict[str, Path], family: str, case: str, device: str) -> None:
    model_dir = tiny_model_dirs[family]
    images = [make_image(w, h, color) for w, h, color in CASES[case]]
    vision, lm = VisionHalf(model_dir, device=device), LanguageHalf(model_dir, device=device)
    ids = render(lm.tokenizer, _messages(len(images)), chat_template(lm.tokenizer, model_dir))
    features = _through_connector(vision.encode(images)) if images else []
    prompt = build_prompt(lm, ids, features)
    ours = list(generate(lm, prompt, lambda logits: int(torch.argmax(logits)), NUM_NEW, eos_ids=set()))
    prompt_text = lm.tokenizer.decode(ids)
    assert ours == _reference(model_dir, prompt_text, images, device)
    assert len(set(ours)) > 1, "degenerate random model: the comparison would prove little"


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_accepts_what_the_encoder_makes_at_any_size(tiny_model_dirs: dict[str, Path], family: str,
                                                            device: str) -> None:
    """Each image's span has one image token per embedding row and only the family's layout tokens."""
    vision = VisionHalf(tiny_model_dirs[family], device=device)
    check = EmbeddingCheck(LanguageHalf(tiny_model_dirs[family]))
    feats = vision.encode([make_image(w, h) for w, h in [(224, 224), (168, 112), (500, 90), (90, 500)]])
    assert [check(f) for f in feats] == [None] * 4
    assert len({f.num_tokens for f in feats}) > 1 or check.fixed is not None  # sizes matter unless fixed
