"""Gemma 3 on the slot engine: image tokens attend both ways within their image in chunked and batched prefill,
the sliding window holds, and the "\\n\\n" the processor writes around each image tokenizes as it does there."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoProcessor
from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model, get_block_sequence_ids_for_mask

from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.step_plan import causal_mask
from decoder_service.generate import generate
from decoder_service.prompt import Prompt, build_prompt
from epd_models.chat import ImageEdges, chat_template, image_edges, render
from epd_models.gemma3 import Gemma3Adapter, ImageBlocks, layer_masks
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.splice import splice_spans
from tests.decoder_service.test_batch import batched
from tests.factories import make_image
from tests.models.test_parity import _reference

NUM_NEW = 12  # tests/decoder_service/test_batch.py's `batched` makes as many
RED, BLUE = (224, 224, "red"), (168, 112, "blue")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["gemma3"]


@pytest.fixture(scope="module")
def vision(model_dir: Path) -> VisionHalf:
    return VisionHalf(model_dir)


@pytest.fixture(scope="module")
def lm(model_dir: Path) -> LanguageHalf:
    return LanguageHalf(model_dir)


def messages(num_images: int, text: str = "What color is the shape?") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def ids_of(lm: LanguageHalf, msgs: list[dict[str, Any]], edges: bool = True) -> list[int]:
    template = chat_template(lm.tokenizer, lm.model_dir)
    return render(lm.tokenizer, msgs, template, image_edges=image_edges(lm) if edges else None)


def make_prompt(vision: VisionHalf, lm: LanguageHalf, sizes: list[tuple[int, int, str]], text: str = "What color is "
                "the shape?") -> Prompt:
    features = vision.encode([make_image(w, h, c) for w, h, c in sizes]) if sizes else []
    return build_prompt(lm, ids_of(lm, messages(len(sizes), text)), features)


def greedy(lm: LanguageHalf, prompt: Prompt, chunk: int | None = None) -> list[int]:
    return list(generate(lm, prompt, lambda logits: int(torch.argmax(logits)), NUM_NEW, eos_ids=set(), chunk=chunk))


# masks


def hf_masks(text_config: Any, is_image: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' own prefill masks for one sequence (1, 1, L, L)."""
    length = is_image.shape[0]
    return create_masks_for_vision_model(
        config=text_config, inputs_embeds=torch.zeros(1, length, 8), attention_mask=None, cache=None,
        position_ids=torch.arange(length)[None], block_sequence_ids=get_block_sequence_ids_for_mask(is_image[None]))


def two_image_prompt(model_dir: Path) -> tuple[Any, Gemma3Adapter, torch.Tensor, ImageBlocks, int]:
    """30 positions, images at [3, 13) and [15, 27): blocks longer than the sliding window (8)."""
    cfg = AutoConfig.from_pretrained(model_dir)
    adapter = Gemma3Adapter(LanguageHalf(model_dir).adapter.spec)
    ids = torch.zeros(1, 30, dtype=torch.long)
    ids[0, 3:13] = ids[0, 15:27] = cfg.image_token_id
    state = adapter.prefill_state(cfg, ids, [], torch.device("cpu"))
    assert state is not None and state.spans == ((3, 13), (15, 27))
    assert cfg.text_config.sliding_window < 10
    return cfg, adapter, ids, state, cfg.text_config.sliding_window


def test_chunk_end_never_cuts_an_image(model_dir: Path) -> None:
    _, adapter, _, state, _ = two_image_prompt(model_dir)
    assert [adapter.chunk_end(state, 0, e) for e in (3, 4, 12, 13, 14)] == [3, 3, 3, 13, 14]
    assert [adapter.chunk_end(state, 3, e) for e in (4, 13, 15, 16)] == [13, 13, 15, 15]  # from a block's start
    assert adapter.chunk_end(None, 0, 5) == 5


def test_masks_match_transformers_in_chunks_and_rows(model_dir: Path) -> None:
    cfg, adapter, ids, state, _ = two_image_prompt(model_dir)
    tc = cfg.get_text_config()
    tc._attn_implementation = "sdpa"  # transformers' boolean masks
    is_image = torch.cat([ids[0] == cfg.image_token_id, torch.zeros(4, dtype=torch.bool)])  # 4 generated tokens
    want = hf_masks(tc, is_image)
    # prefill in chunks of at most 5 that never end inside an image
    start = 0
    while start < 30:
        end = adapter.chunk_end(state, start, min(start + 5, 30))
        got = adapter.attention_mask(cfg, causal_mask([start], end - start), [start], [state])
        for kind, mask in got.items():
            assert torch.equal(mask[0, 0], want[kind][0, 0, start:end, :end]), (kind, start, end)
        start = end
    # decode: three rows at their own positions, one of them text only
    text_only = hf_masks(tc, torch.zeros(34, dtype=torch.bool))
    starts = [31, 12, 33]
    got = adapter.attention_mask(cfg, causal_mask(starts, 1), starts, [state, None, state])
    for kind, mask in got.items():
        for row, (pos, ref) in enumerate(zip(starts, [want, text_only, want], strict=True)):
            assert torch.equal(mask[row, 0, 0], ref[kind][0, 0, pos, :34]), (kind, row)


def test_masks_for_two_prefilling_rows_at_once(model_dir: Path) -> None:
    """Each row's queries at its own positions, with its own prompt's blocks (one row's image is not the other's)."""
    cfg, _, ids, state, window = two_image_prompt(model_dir)
    other = ImageBlocks(torch.full((30,), -1), ())
    got = layer_masks(causal_mask([3, 5], 10), [state, other], window)
    alone = layer_masks(causal_mask([3], 10), [state], window)
    text = layer_masks(causal_mask([5], 10), [None], window)
    for kind in ("full_attention", "sliding_attention"):
        assert torch.equal(got[kind][0, :, :, :13], alone[kind][0]) and not got[kind][0, :, :, 13:].any()
        assert torch.equal(got[kind][1], text[kind][0])
        assert got[kind][0, 0, 0, 12]  # position 3 sees 12 in its block, 9 > the window ahead: the window is one-sided


# the split path


def test_chunked_prefill_through_images_matches_generate(vision: VisionHalf, lm: LanguageHalf,
                                                         model_dir: Path) -> None:
    images = [make_image(w, h, c) for w, h, c in (RED, BLUE)]
    prompt = make_prompt(vision, lm, [RED, BLUE])
    reference = _reference(model_dir, str(lm.tokenizer.decode(ids_of(lm, messages(2), edges=False))), images, "cpu")
    whole = greedy(lm, prompt)
    assert whole == reference[:NUM_NEW]
    assert greedy(lm, prompt, chunk=3) == whole  # every chunk boundary near an image is moved out of it
    assert greedy(lm, prompt, chunk=7) == whole


def test_batched_rows_equal_each_alone(vision: VisionHalf, lm: LanguageHalf) -> None:
    prompts = [make_prompt(vision, lm, sizes, text) for sizes, text in [
        ([], "What color is the shape? " * 4), ([RED], "What color is the shape?"), ([BLUE, RED], "What shape?"),
        ([BLUE], "It is a red circle. " * 3)]]
    alone = [greedy(lm, p) for p in prompts]
    assert len({tuple(a) for a in alone}) == len(alone), "prompts too alike to prove anything"
    assert batched(lm, prompts, max_slots=3, chunk=16, budget=24) == alone  # chunks of 16 would cut each image
    assert batched(lm, prompts, max_slots=4, chunk=256, budget=4096) == alone


def test_without_the_image_block_mask_the_ids_differ(vision: VisionHalf, lm: LanguageHalf,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = make_prompt(vision, lm, [RED, BLUE])
    right = greedy(lm, prompt)
    window = lm.config.get_text_config().sliding_window
    monkeypatch.setattr(lm.adapter, "attention_mask",
                        lambda cfg, mask, starts, states: layer_masks(mask, [None] * len(states), window))
    assert greedy(lm, prompt) != right


def test_a_different_image_changes_the_logits(vision: VisionHalf, lm: LanguageHalf) -> None:
    """The projector transformers zero-initialises is randomised by the builder, so the image is really seen."""
    red, blue = (make_prompt(vision, lm, [size]) for size in ((224, 224, "red"), (224, 224, "blue")))
    assert torch.equal(red.input_ids, blue.input_ids)
    logits = [prefill_logits(lm, p) for p in (red, blue)]
    assert (logits[0] - logits[1]).abs().max() > 1e-3


@torch.inference_mode()
def prefill_logits(lm: LanguageHalf, prompt: Prompt) -> torch.Tensor:
    runner = ModelRunner(lm, max_slots=1, max_len=prompt.num_tokens + 1)
    runner.add(0, prompt)
    return runner.prefill(prompt.num_tokens)[0]


# text edges


@pytest.mark.parametrize("sizes", [[RED], [RED, BLUE]])
def test_prompt_ids_equal_the_processors(vision: VisionHalf, lm: LanguageHalf, model_dir: Path,
                                         sizes: list[tuple[int, int, str]]) -> None:
    images = [make_image(w, h, c) for w, h, c in sizes]
    processor = AutoProcessor.from_pretrained(model_dir)
    plain = ids_of(lm, messages(len(images)), edges=False)
    want = processor(text=[lm.tokenizer.decode(plain)], images=images)["input_ids"][0]
    spans = [f.span for f in vision.encode(images)]
    assert spans[0] is not None and "\n" not in lm.tokenizer.decode(list(spans[0]))  # the encoder ships the core only
    assert splice_spans(ids_of(lm, messages(len(images))), lm.placeholder_id, spans) == want  # type: ignore[arg-type]
    # the edges tokenized apart from their neighbours (the span's own "\n\n") give other ids: the hazard is live
    edges = lm.tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    naive = [[*edges, *s, *edges] for s in spans if s is not None]
    assert splice_spans(plain, lm.placeholder_id, naive) != want


def test_user_text_placeholder_gets_no_edges(lm: LanguageHalf) -> None:
    msgs = messages(1, "see <start_of_image> here")
    ids = ids_of(lm, msgs)
    assert ids.count(lm.placeholder_id) == 1  # the user's string stays ordinary tokens
    rendered = str(lm.tokenizer.apply_chat_template(msgs, chat_template=chat_template(lm.tokenizer, lm.model_dir),
                                                    tokenize=False, add_generation_prompt=True))
    assert lm.tokenizer.decode(ids) == rendered.replace("<start_of_image>", "\n\n<start_of_image>\n\n", 1)


def test_edges_in_the_fallback_render(lm: LanguageHalf) -> None:
    """A template that changes user text (here: trims it) takes render()'s defanged path; it writes edges too."""
    template = chat_template(lm.tokenizer, lm.model_dir).replace("{{ c['text'] }}", "{{ c['text'] | trim }}")
    assert template != chat_template(lm.tokenizer, lm.model_dir)
    msgs = messages(1, "  What color is the shape?  ")
    ids = render(lm.tokenizer, msgs, template, image_edges=image_edges(lm))
    want = render(lm.tokenizer, messages(1), chat_template(lm.tokenizer, lm.model_dir), image_edges=image_edges(lm))
    assert ids == want


def test_wrap_moves_user_spans_and_skips_placeholders_inside_them() -> None:
    edges = ImageEdges("<p>", "[", "]]")
    assert edges.wrap("ab<p>cd<p>", [(0, 2), (5, 7)]) == ("ab[<p>]]cd[<p>]]", [(0, 2), (8, 10)])
    assert edges.wrap("x<p>y<p>", [(0, 5)]) == ("x<p>y[<p>]]", [(0, 5)])
