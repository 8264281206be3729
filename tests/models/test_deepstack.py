"""Qwen3-VL's (and Qwen3-VL-MoE's) DeepStack on the split path: chunked prefill injects each chunk's rows, the
features matter, and the M-RoPE positions are the family's own (test_parity.py covers the split path ==
model.generate()).

Runs on --device (default cpu), like test_parity.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from decoder_service.embedding_check import EmbeddingCheck
from decoder_service.engine.model_runner import ModelRunner
from decoder_service.generate import generate
from decoder_service.prompt import Prompt, build_prompt
from epd_contracts.embeddings import ImageFeatures
from epd_models.chat import chat_template, render
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.processors import load_processor
from tests.factories import make_image

NUM_NEW = 12
SIZES = [(224, 224), (168, 112)]  # 9 and 6 image tokens
FAMILIES = ("qwen3_vl", "qwen3_vl_moe")  # every test runs on each: Qwen3-VL-MoE is Qwen3-VL with MoE LM layers


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs[request.param]


@pytest.fixture(scope="module")
def vision(model_dir: Path, device: str) -> VisionHalf:
    return VisionHalf(model_dir, device=device)


@pytest.fixture(scope="module")
def lm(model_dir: Path, device: str) -> LanguageHalf:
    return LanguageHalf(model_dir, device=device)


def make_prompt(lm: LanguageHalf, features: list[ImageFeatures]) -> Prompt:
    return build_prompt(lm, render_ids(lm, len(features)), features)


def render_ids(lm: LanguageHalf, num_images: int) -> list[int]:
    parts: list[dict] = [{"type": "image"} for _ in range(num_images)]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What color is the shape?"}]}]
    return render(lm.tokenizer, messages, chat_template(lm.tokenizer, lm.model_dir))


def greedy(lm: LanguageHalf, prompt: Prompt, chunk: int | None = None) -> list[int]:
    return list(generate(lm, prompt, lambda logits: int(torch.argmax(logits)), NUM_NEW, eos_ids=set(), chunk=chunk))


@torch.inference_mode()
def prefill_logits(lm: LanguageHalf, prompt: Prompt, chunk: int) -> torch.Tensor:
    runner = ModelRunner(lm, max_slots=1, max_len=prompt.num_tokens + 1, chunk=chunk)
    runner.add(0, prompt)
    done: dict[object, torch.Tensor] = {}
    while not done:
        done = runner.prefill(chunk)
    return done[0]


def image_runs(prompt: Prompt, image_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of image tokens."""
    ids = prompt.input_ids[0].tolist()
    starts = [i for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != image_id)]
    return [(s, next((j for j in range(s, len(ids)) if ids[j] != image_id), len(ids))) for s in starts]


def test_features_carry_one_deepstack_set_per_vision_layer(vision: VisionHalf, lm: LanguageHalf) -> None:
    feats = vision.encode([make_image(w, h) for w, h in SIZES])
    assert [tuple(f.deepstack.shape) for f in feats if f.deepstack is not None] == [(2, 9, 64), (2, 6, 64)]
    assert all(not torch.equal(f.deepstack[0], f.deepstack[1]) for f in feats if f.deepstack is not None)
    assert [EmbeddingCheck(lm)(f) for f in feats] == [None, None]


@pytest.mark.parametrize("chunk", [3, 4, 5])
def test_chunked_prefill_through_images_matches_whole_prefill(vision: VisionHalf, lm: LanguageHalf,
                                                              chunk: int) -> None:
    prompt = make_prompt(lm, vision.encode([make_image(w, h, c) for (w, h), c in zip(SIZES, ["red", "blue"], strict=True)]))
    runs = image_runs(prompt, lm.image_token_id)
    assert any(s // chunk < (e - 1) // chunk for s, e in runs), "no chunk boundary inside an image"
    assert greedy(lm, prompt, chunk=chunk) == greedy(lm, prompt)
    torch.testing.assert_close(prefill_logits(lm, prompt, chunk), prefill_logits(lm, prompt, prompt.num_tokens))


def test_chunks_without_image_positions_get_no_deepstack_arguments(vision: VisionHalf, lm: LanguageHalf) -> None:
    prompt = make_prompt(lm, vision.encode([make_image(*SIZES[0])]))
    (start, end), = image_runs(prompt, lm.image_token_id)
    state = lm.prefill_state(prompt.input_ids, prompt.images)
    assert lm.adapter.prefill_kwargs(state, 0, start) == {}
    assert lm.adapter.prefill_kwargs(state, end, prompt.num_tokens) == {}
    inside = lm.adapter.prefill_kwargs(state, start - 1, start + 2)  # one text position, two image positions
    assert inside["visual_pos_masks"].device == lm.device and inside["visual_pos_masks"].tolist() == [[False, True, True]]
    deep = prompt.images[0].deepstack
    assert deep is not None
    assert [d.tolist() for d in inside["deepstack_visual_embeds"]] == [d[:2].tolist() for d in deep]


def test_decoder_refuses_features_without_deepstack(vision: VisionHalf, lm: LanguageHalf) -> None:
    feats = vision.encode([make_image(*SIZES[0])])[0]
    bare = ImageFeatures(embeds=feats.embeds, grid_thw=feats.grid_thw, span=feats.span)
    reason = EmbeddingCheck(lm)(bare)
    assert reason is not None and "DeepStack" in reason


def test_dropping_deepstack_changes_the_output(vision: VisionHalf, lm: LanguageHalf,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = make_prompt(lm, vision.encode([make_image(w, h) for w, h in SIZES]))
    with_deepstack = greedy(lm, prompt)
    logits = prefill_logits(lm, prompt, prompt.num_tokens)
    monkeypatch.setattr(lm.adapter, "prefill_kwargs", lambda state, start, end: {})
    assert greedy(lm, prompt) != with_deepstack
    assert not torch.allclose(prefill_logits(lm, prompt, prompt.num_tokens), logits, atol=1e-3)


def test_a_different_image_changes_the_logits(vision: VisionHalf, lm: LanguageHalf) -> None:
    red, blue = (vision.encode([make_image(224, 224, color)]) for color in ("red", "blue"))
    first, second = (prefill_logits(lm, make_prompt(lm, f), 64) for f in (red, blue))
    assert (first - second).abs().max() > 1e-2


def test_mrope_positions_equal_the_family_rope_index(model_dir: Path, vision: VisionHalf, lm: LanguageHalf) -> None:
    """Our M-RoPE positions (MRopeAdapter) == Qwen3VLModel.get_rope_index on the processor's own inputs."""
    images = [make_image(w, h) for w, h in [*SIZES, (500, 90), (90, 500)]]
    prompt = make_prompt(lm, vision.encode(images))
    ours, delta = lm.position_ids(prompt.input_ids, prompt.images)
    proc = load_processor(model_dir)
    rendered = lm.tokenizer.decode(render_ids(lm, len(images)))
    ref_in = proc(text=[rendered], images=images, return_tensors="pt", return_mm_token_type_ids=True)
    assert ref_in["input_ids"].tolist() == prompt.input_ids.tolist()
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    ref, ref_delta = model.model.get_rope_index(ref_in["input_ids"], mm_token_type_ids=ref_in["mm_token_type_ids"],
                                                image_grid_thw=ref_in["image_grid_thw"])
    assert torch.equal(ours.cpu(), ref) and delta == int(ref_delta)
    assert len({g for g in (f.grid_thw for f in prompt.images)}) == len(images)  # the sizes really differ

