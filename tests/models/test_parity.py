"""The split path (vision half -> connector wire -> language half) equals model.generate() token for token.

Both run on --device (default cpu; `python -m epd_bench.gpu_check` runs them on cuda)."""
from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, GenerationConfig

from decoder_service.embedding_check import EmbeddingCheck
from decoder_service.engine.model_runner import ModelRunner
from decoder_service.generate import generate
from decoder_service.prompt import Prompt, build_prompt
from epd_builders.tiny import FAMILIES
from epd_contracts.hashing import MULTI_IMAGE_FAMILIES, multi_image_item
from epd_models.chat import chat_template, image_edges, render
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import make_image, through_connector

NUM_NEW = 16
CASES = {
    "text_only": [],
    "one_image": [(224, 224, "red")],
    "two_images_of_different_sizes": [(224, 224, "red"), (168, 112, "blue")],
}


def _messages(num_images: int) -> list[dict]:
    parts: list[dict] = [{"type": "image"} for _ in range(num_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What color is the shape?"}]}]


def _prompt(lm: LanguageHalf, vision: VisionHalf, model_dir: Path, case: str) -> tuple[Prompt, list, str]:
    """Our prompt (through the connector), its images, and the text the family's processor is given for them."""
    images = [make_image(w, h, color) for w, h, color in CASES[case]]
    template = chat_template(lm.tokenizer, model_dir)
    ids = render(lm.tokenizer, _messages(len(images)), template, image_edges=image_edges(lm))
    plain = render(lm.tokenizer, _messages(len(images)), template)  # the processor writes the edges itself
    multi = multi_image_item(lm.config.model_type, len(images))  # LLaVA-OneVision: base tiles only
    features = through_connector(vision.encode(images, multi_image=multi)) if images else []
    return build_prompt(lm, ids, features), images, str(lm.tokenizer.decode(plain))


def _argmax(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def _reference(model_dir: Path, prompt_text: str, images: list, device: str,
               model: torch.nn.Module | None = None, **sampling: object) -> list[int]:
    """transformers' greedy tokens (`model`: this one instead of the checkpoint's, e.g. with a LoRA merged;
    `sampling`: generation settings instead of greedy, e.g. do_sample with a temperature)."""
    proc = AutoProcessor.from_pretrained(model_dir)
    model = (model or AutoModelForImageTextToText.from_pretrained(model_dir)).eval().to(device)
    # one prompt's images, nested where the family counts the images per prompt (LLaVA-OneVision)
    nested = [images] if images and AutoConfig.from_pretrained(model_dir).model_type in MULTI_IMAGE_FAMILIES else images
    inputs = proc(text=[prompt_text], images=nested or None, return_tensors="pt").to(device)
    cfg = GenerationConfig(**{"max_new_tokens": NUM_NEW, "do_sample": False, "eos_token_id": None, "pad_token_id": 0,
                              **sampling})
    out = model.generate(**inputs, generation_config=cfg)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_split_path_matches_generate(tiny_model_dirs: dict[str, Path], family: str, case: str, device: str) -> None:
    model_dir = tiny_model_dirs[family]
    vision, lm = VisionHalf(model_dir, device=device), LanguageHalf(model_dir, device=device)
    prompt, images, prompt_text = _prompt(lm, vision, model_dir, case)
    ours = list(generate(lm, prompt, _argmax, NUM_NEW, eos_ids=set()))
    assert ours == _reference(model_dir, prompt_text, images, device)
    assert len(set(ours)) > 1, "degenerate random model: the comparison would prove little"


def _batched(lm: LanguageHalf, prompts: list[Prompt], num_new: int, chunk: int, budget: int) -> list[list[int]]:
    """The engine's schedule on the slot cache: each step decodes every prefilled row, then prefills within `budget`
    in chunks of at most `chunk` tokens (so chunks cut through images and rows join mid-way)."""
    runner = ModelRunner(lm, max_slots=len(prompts), max_len=max(p.num_tokens for p in prompts) + num_new + 1,
                         chunk=chunk)
    for key, prompt in enumerate(prompts):
        runner.add(key, prompt)
    out: dict[int, list[int]] = {key: [] for key in range(len(prompts))}
    feed: dict[Hashable, int] = {}
    while any(len(tokens) < num_new for tokens in out.values()):
        logits = runner.decode(feed) if feed else {}
        logits.update(runner.prefill(budget))
        feed = {}
        for key, row_logits in logits.items():
            assert isinstance(key, int)
            out[key].append(_argmax(row_logits))
            if len(out[key]) < num_new:
                feed[key] = out[key][-1]
            else:
                runner.remove(key)
    return [out[key] for key in range(len(prompts))]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_prompts_equal_each_alone(tiny_model_dirs: dict[str, Path], family: str, device: str) -> None:
    """Text only, one image and two images in one batch, prefilled in chunks of 5 within a budget of 7 tokens per
    step while the others decode: each gives the ids it gives alone."""
    model_dir = tiny_model_dirs[family]
    vision, lm = VisionHalf(model_dir, device=device), LanguageHalf(model_dir, device=device)
    prompts = [_prompt(lm, vision, model_dir, case)[0] for case in CASES]
    alone = [list(generate(lm, p, _argmax, NUM_NEW, eos_ids=set())) for p in prompts]
    assert _batched(lm, prompts, NUM_NEW, chunk=5, budget=7) == alone
    assert len({tuple(a) for a in alone}) > 1, "the prompts must not all give one answer"


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_accepts_what_the_encoder_makes_at_any_size(tiny_model_dirs: dict[str, Path], family: str,
                                                            device: str) -> None:
    """Each image's span has one image token per embedding row and only the family's layout tokens."""
    vision = VisionHalf(tiny_model_dirs[family], device=device)
    check = EmbeddingCheck(LanguageHalf(tiny_model_dirs[family]))
    feats = vision.encode([make_image(w, h) for w, h in [(224, 224), (168, 112), (500, 90), (90, 500)]])
    assert [check(f) for f in feats] == [None] * 4
    assert len({f.num_tokens for f in feats}) > 1 or check.fixed is not None  # sizes matter unless fixed
