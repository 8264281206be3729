"""The tiled families (LLaVA-NeXT, InternVL, Mistral 3 / Pixtral, Idefics3): real checkpoints' processor names and
key layouts load, each image's span is what the family writes, the decoder refuses a span it would not write, and
the image-token counts of real-size configurations (what the connector carries per image)."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Idefics3Processor, LlavaNextProcessor
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

from decoder_service.embedding_check import EmbeddingCheck
from epd_builders.families.idefics3 import TOKENS_PER_TILE as IDEFICS3_PER_TILE
from epd_builders.families.internvl import TOKENS_PER_TILE as INTERNVL_PER_TILE
from epd_contracts.embeddings import ImageFeatures
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.pixtral_processor import PixtralProcessorPil
from epd_models.processors import InternVLImageProcessorOnly, load_processor
from tests.factories import make_image

# family -> the processor class its real checkpoints name in processor_config.json
STOCK = {"llava_next": "LlavaNextProcessor", "internvl": "InternVLProcessor", "mistral3": "PixtralProcessor",
         "idefics3": "Idefics3Processor"}
TILED = tuple(STOCK)
SIZES = [(224, 224), (168, 112)]  # (width, height): the parity test's two images


def _images() -> list[Image.Image]:
    return [make_image(w, h) for w, h in SIZES]


def _same_features(a: list[ImageFeatures], b: list[ImageFeatures]) -> bool:
    return all(x.span == y.span and torch.equal(x.embeds, y.embeds) for x, y in zip(a, b, strict=True))


# real checkpoints' processor names


def _as_stock(src: Path, dst: Path, family: str, split: bool) -> None:
    """`src` with the stock processor class named, as a hub checkpoint has it; `split`: the image processor in its own
    preprocessor_config.json under its fast (torchvision) class name, as older checkpoints have it."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "processor_config.json").read_text())
    cfg["processor_class"] = STOCK[family]
    if split:
        image_cfg = cfg.pop("image_processor")
        image_cfg["image_processor_type"] += "Fast"
        image_cfg["processor_class"] = STOCK[family]
        (dst / "preprocessor_config.json").write_text(json.dumps(image_cfg))
    (dst / "processor_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("split", [False, True], ids=["one_file", "preprocessor_config"])
@pytest.mark.parametrize("family", TILED)
def test_a_checkpoint_naming_the_stock_processor_encodes_the_same(tiny_model_dirs: dict[str, Path], tmp_path: Path,
                                                                  family: str, split: bool) -> None:
    src, dst = tiny_model_dirs[family], tmp_path / family
    _as_stock(src, dst, family, split)
    assert json.loads((dst / "processor_config.json").read_text())["processor_class"] == STOCK[family]
    assert _same_features(VisionHalf(dst).encode(_images()), VisionHalf(src).encode(_images()))


def test_pixtral_processor_returns_tensors_by_default_as_the_stock_one(tiny_model_dirs: dict[str, Path]) -> None:
    proc = load_processor(tiny_model_dirs["mistral3"])
    out = proc(text=[proc.image_token], images=[make_image(100, 60)])
    assert all(isinstance(out[k], torch.Tensor) for k in ("input_ids", "pixel_values", "image_sizes"))


# key layouts

LEGACY_TO_NEW = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
                 "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}
# family -> {prefix in the saved checkpoint: prefix in the other layout}
OTHER_LAYOUT = {
    "llava_next": {**LEGACY_TO_NEW, "image_newline": "model.image_newline"},
    "internvl": LEGACY_TO_NEW,
    "mistral3": LEGACY_TO_NEW,
    "idefics3": {"model.text_model.": "text_model.", "model.vision_model.": "vision_model.",
                 "model.connector.": "connector."},
}


def _renamed(tensors: dict[str, torch.Tensor], renames: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in tensors.items():
        prefix = next((p for p in renames if key.startswith(p)), "")
        out[renames[prefix] + key[len(prefix):] if prefix else key] = tensor
    return out


@pytest.mark.parametrize("family", TILED)
def test_the_other_key_layout_loads_the_same_weights(tiny_model_dirs: dict[str, Path], tmp_path: Path,
                                                     family: str) -> None:
    src, dst = tiny_model_dirs[family], tmp_path / family
    shutil.copytree(src, dst)
    saved = load_file(str(src / "model.safetensors"))
    renamed = _renamed(saved, OTHER_LAYOUT[family])
    assert len(renamed) == len(saved) and set(renamed) & set(saved) <= {"lm_head.weight"}  # every other key moved
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    assert _same_features(VisionHalf(dst).encode(_images()), VisionHalf(src).encode(_images()))
    a, b = LanguageHalf(dst).module.state_dict(), LanguageHalf(src).module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# spans


def _ids(tok: Any, *tokens: str) -> list[int]:
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def _internvl_span(tok: Any, size: tuple[int, int]) -> list[int]:
    """<img>, the context token for each tile (and the thumbnail), </img>: 224x224 is cut 2x2, 168x112 3x2."""
    tiles = {(224, 224): 4 + 1, (168, 112): 6 + 1}[size]
    start, ctx, end = _ids(tok, "<img>", "<IMG_CONTEXT>", "</img>")
    return [start, *[ctx] * (INTERNVL_PER_TILE * tiles), end]


def _pixtral_span(tok: Any, size: tuple[int, int]) -> list[int]:
    """A row of [IMG] per 16 px (longest edge 64), each row ended by [IMG_BREAK], the last by [IMG_END]."""
    rows, cols = {(224, 224): (4, 4), (168, 112): (3, 4)}[size]
    img, brk, end = _ids(tok, "[IMG]", "[IMG_BREAK]", "[IMG_END]")
    span = ([img] * cols + [brk]) * rows
    return [*span[:-1], end]


def _idefics3_span(tok: Any, size: tuple[int, int]) -> list[int]:
    """32 px tiles of the image resized to 96 px: <fake><row_i_col_j> images, a newline per row, then the global one."""
    rows, cols = {(224, 224): (3, 3), (168, 112): (2, 3)}[size]
    fake, image = "<fake_token_around_image>", "<image>" * IDEFICS3_PER_TILE
    text = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n" for r in range(rows))
    text += f"\n{fake}<global-img>{image}{fake}"
    return list(tok(text, add_special_tokens=False)["input_ids"])


SPANS = {"internvl": _internvl_span, "mistral3": _pixtral_span, "idefics3": _idefics3_span}
# LLaVA-NeXT writes image tokens only: 4x4 for the base image, then 8x8 for the 2x2 tiles, unpadded to 6 rows for
# 168x112, each row followed by image_newline
LLAVA_NEXT_TOKENS = {(224, 224): 16 + 8 * (8 + 1), (168, 112): 16 + 6 * (8 + 1)}


@pytest.mark.parametrize("family", TILED)
def test_each_image_span_is_what_the_family_writes(tiny_model_dirs: dict[str, Path], family: str) -> None:
    vision = VisionHalf(tiny_model_dirs[family])
    tok = vision.processor.tokenizer
    feats = vision.encode(_images())
    if family == "llava_next":
        assert [(f.span, f.num_tokens) for f in feats] == [(None, LLAVA_NEXT_TOKENS[s]) for s in SIZES]
        return
    assert [list(f.span or ()) for f in feats] == [SPANS[family](tok, s) for s in SIZES]
    image_id = vision.adapter.image_token_id(vision.config)
    assert [f.num_tokens for f in feats] == [sum(t == image_id for t in f.span or ()) for f in feats]


@pytest.mark.parametrize("family", TILED)
def test_the_decoder_refuses_a_span_the_family_would_not_write(tiny_model_dirs: dict[str, Path], family: str) -> None:
    lm = LanguageHalf(tiny_model_dirs[family])
    check = EmbeddingCheck(lm)
    feat = VisionHalf(tiny_model_dirs[family]).encode(_images()[:1])[0]
    assert check(feat) is None
    span = list(feat.span or [lm.image_token_id] * feat.num_tokens)
    tok: Any = lm.tokenizer
    added = tok.convert_tokens_to_ids("<|im_start|>")  # another special token
    plain = tok(" red", add_special_tokens=False)["input_ids"][0]  # ordinary text
    for foreign in (added, plain):
        with_foreign = replace(feat, span=(span[0], foreign, *span[1:]))
        assert "not this model's image layout" in str(check(with_foreign))
    first = span.index(lm.image_token_id)
    one_short = replace(feat, span=(*span[:first], *span[first + 1:]))
    assert "image tokens !=" in str(check(one_short))


# real-size configurations: image tokens per 1024x768 image (connector bytes = tokens x text hidden x 2, bf16)


def _llava_next_7b(tok: Any) -> Any:
    """llava-v1.6 7B: CLIP-L/336, the default pinpoints."""
    pins = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    ip = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                    image_grid_pinpoints=pins)
    return LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=14,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1)


def _internvl3_8b(tok: Any) -> Any:
    """InternVL3-8B: 448 px tiles, 256 tokens each, at most 12 tiles and a thumbnail."""
    ip = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1,
                                  max_patches=12)
    return InternVLImageProcessorOnly(image_processor=ip, tokenizer=tok, image_seq_length=256)


def _mistral_small_3_1(tok: Any) -> Any:
    """Mistral-Small-3.1: patch 14, 2x2 merge, longest edge 1540."""
    ip = PixtralImageProcessorPil(size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14})
    return PixtralProcessorPil(image_processor=ip, tokenizer=tok, patch_size=14, spatial_merge_size=2)


def _idefics3_8b(tok: Any) -> Any:
    """Idefics3-8B: 364 px tiles of 169 tokens, longest edge 4 x 364."""
    ip = Idefics3ImageProcessorPil(size={"longest_edge": 4 * 364}, max_image_size={"longest_edge": 364})
    return Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=169)


# family -> (real-size processor, image tokens, span length) for 1024x768
REAL_SIZE: dict[str, tuple[Any, int, int]] = {
    "llava_next": (_llava_next_7b, 576 + 36 * (48 + 1), 2340),  # 2x2 tiles of 24x24, unpadded to 36 rows: 19.2 MB
    "internvl": (_internvl3_8b, 256 * (12 + 1), 3330),  # a 4x3 cut and the thumbnail: 23.9 MB at hidden 3584
    "mistral3": (_mistral_small_3_1, 37 * 28, 37 * 28 + 28),  # 28 rows of 37 (28 px each): 10.6 MB at hidden 5120
    "idefics3": (_idefics3_8b, 169 * (12 + 1), 2228),  # upscaled to 1456x1092: 4x3 tiles + global: 18.0 MB
}


@pytest.mark.parametrize("family", TILED)
def test_real_size_image_tokens_for_a_1024x768_image(tiny_model_dirs: dict[str, Path], family: str) -> None:
    make, num_image_tokens, span_len = REAL_SIZE[family]
    proc = make(AutoTokenizer.from_pretrained(tiny_model_dirs[family]))
    span = proc(text=[proc.image_token], images=[make_image(1024, 768)], add_special_tokens=False)["input_ids"][0]
    assert (sum(t == proc.image_token_id for t in span), len(span)) == (num_image_tokens, span_len)
