"""Connector bytes per image for every family, tiny test checkpoint and real size, for one 1024x768 image.

    python -m epd_bench.family_bytes [--json]

What the connector carries for an image is its rows: image tokens x the LM's hidden size x dtype bytes, plus
one more set of rows per DeepStack layer (Qwen3-VL). The tokens are counted by running the family's PIL
processor on the image (no weights): for "tiny", the processor epd_builders.tiny builds; for "real", the same
processor classes with the real checkpoint's values, next to a config built from transformers' config classes
with its sizes (REAL below; the tiny builder's tokenizer supplies the family's image tokens). Tiny checkpoints
are float32 (4 B), real ones bfloat16 (2 B).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from PIL import Image
from transformers import (
    Gemma3Config,
    Gemma3Processor,
    Idefics3Config,
    Idefics3Processor,
    InternVLConfig,
    LlavaConfig,
    LlavaNextConfig,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaProcessor,
    Mistral3Config,
    Qwen2_5_VLConfig,
    Qwen2VLConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from epd_bench.micro import emit, parser
from epd_builders.families.common import Built
from epd_builders.tiny import BUILDERS, FAMILIES, TinySpec
from epd_models import processors
from epd_models.pixtral_processor import PixtralProcessorPil
from epd_models.registry import adapter_for

IMAGE_SIZE = (1024, 768)  # (width, height)
TINY_DTYPE_BYTES, REAL_DTYPE_BYTES = 4, 2  # float32 tiny checkpoints; bfloat16 real ones


@dataclass(frozen=True)
class FamilyBytes:
    """One family at one size: what an image costs on the connector."""

    family: str
    size: str  # "tiny" | "real"
    checkpoint: str
    image_tokens: int  # rows of the main embeddings
    hidden_size: int  # the LM's
    deepstack_layers: int  # extra row sets (Qwen3-VL: one per deepstack_visual_indexes entry)
    dtype_bytes: int

    @property
    def num_bytes(self) -> int:
        return self.image_tokens * self.hidden_size * self.dtype_bytes * (1 + self.deepstack_layers)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "bytes": self.num_bytes}


@dataclass(frozen=True)
class Real:
    """A real checkpoint: its config (transformers' classes, its sizes) and its processor (its preprocessor values)."""

    checkpoint: str
    config: Callable[[], Any]
    processor: Callable[[Any, Any], Any]  # (config, tokenizer) -> processor


def _qwen_processor(cls: type, min_pixels: int, max_pixels: int, **extra: Any) -> Callable[[Any, Any], Any]:
    def make(cfg: Any, tok: Any) -> Any:
        vc = cfg.vision_config
        ip = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                      patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                                      temporal_patch_size=vc.temporal_patch_size, **extra)
        return cls(image_processor=ip, tokenizer=tok)
    return make


def _llava_processor(cfg: Any, tok: Any) -> Any:
    side = cfg.vision_config.image_size
    ip = LlavaImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=cfg.vision_config.patch_size,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def _llava_next_processor(cfg: Any, tok: Any) -> Any:
    side = cfg.vision_config.image_size
    ip = LlavaNextImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                    image_grid_pinpoints=cfg.image_grid_pinpoints)
    return LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=cfg.vision_config.patch_size,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1)


def _onevision_processor(cfg: Any, tok: Any) -> Any:
    side = cfg.vision_config.image_size
    ip = LlavaOnevisionImageProcessorPil(size={"height": side, "width": side},
                                         image_grid_pinpoints=cfg.image_grid_pinpoints)
    return processors.LlavaOnevisionImageProcessorOnly(
        image_processor=ip, tokenizer=tok, num_image_tokens=(side // cfg.vision_config.patch_size) ** 2,
        vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9")


def _gemma3_processor(cfg: Any, tok: Any) -> Any:
    side = cfg.vision_config.image_size
    ip = Gemma3ImageProcessorPil(size={"height": side, "width": side}, do_pan_and_scan=False)
    return Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=cfg.mm_tokens_per_image)


def _internvl_processor(cfg: Any, tok: Any) -> Any:
    h, w = cfg.vision_config.image_size
    ip = GotOcr2ImageProcessorPil(size={"height": h, "width": w}, crop_to_patches=True, min_patches=1, max_patches=12)
    return processors.InternVLImageProcessorOnly(image_processor=ip, tokenizer=tok,
                                                 image_seq_length=cfg.image_seq_length)


def _mistral3_processor(cfg: Any, tok: Any) -> Any:
    vc = cfg.vision_config
    ip = PixtralImageProcessorPil(size={"longest_edge": vc.image_size},
                                  patch_size={"height": vc.patch_size, "width": vc.patch_size})
    return PixtralProcessorPil(image_processor=ip, tokenizer=tok, patch_size=vc.patch_size,
                               spatial_merge_size=cfg.spatial_merge_size)


def _idefics3_processor(cfg: Any, tok: Any) -> Any:
    side = cfg.vision_config.image_size
    ip = Idefics3ImageProcessorPil(size={"longest_edge": 4 * side}, max_image_size={"longest_edge": side})
    seq = (side // cfg.vision_config.patch_size) ** 2 // cfg.scale_factor**2
    return Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=seq)


def _config(cls: type, **kwargs: Any) -> Callable[[], Any]:
    return lambda: cls(**kwargs)


CLIP_L_336 = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
              "image_size": 336, "patch_size": 14, "projection_dim": 768, "model_type": "clip_vision_model"}
LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "model_type": "llama"}
# Qwen3-VL's tower (8B and 30B-A3B alike; out_hidden_size is the LM's width) and its processor
QWEN3_VL_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
                   "spatial_merge_size": 2, "temporal_patch_size": 2, "deepstack_visual_indexes": [8, 16, 24]}
QWEN3_VL_PROCESSOR = _qwen_processor(processors.Qwen3VLImageProcessorOnly, 256 * 256, 4096 * 4096,
                                     image_mean=[0.5] * 3, image_std=[0.5] * 3)
QWEN2_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4}
# family -> its real checkpoint: the sizes of the hub's config.json and the values of its preprocessor_config.json
REAL: dict[str, Real] = {
    "llava": Real("llava-hf/llava-1.5-7b-hf", _config(
        LlavaConfig, vision_config=CLIP_L_336, text_config=LLAMA_7B), _llava_processor),
    "qwen2_vl": Real("Qwen/Qwen2-VL-7B-Instruct", _config(
        Qwen2VLConfig, text_config=QWEN2_7B, vision_config={
            "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "num_heads": 16, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2}),
        _qwen_processor(processors.Qwen2VLImageProcessorOnly, 56 * 56, 28 * 28 * 16384)),
    "qwen2_5_vl": Real("Qwen/Qwen2.5-VL-7B-Instruct", _config(
        Qwen2_5_VLConfig, text_config=QWEN2_7B, vision_config={
            "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "out_hidden_size": 3584, "num_heads": 16,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112}),
        _qwen_processor(processors.Qwen2_5_VLImageProcessorOnly, 56 * 56, 28 * 28 * 16384)),
    "qwen3_vl": Real("Qwen/Qwen3-VL-8B-Instruct", _config(
        Qwen3VLConfig, text_config={"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
        vision_config={**QWEN3_VL_VISION, "out_hidden_size": 4096}), QWEN3_VL_PROCESSOR),
    "qwen3_vl_moe": Real("Qwen/Qwen3-VL-30B-A3B-Instruct", _config(
        Qwen3VLMoeConfig, text_config={"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                                       "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                                       "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8},
        vision_config={**QWEN3_VL_VISION, "out_hidden_size": 2048}), QWEN3_VL_PROCESSOR),
    "llava_next": Real("llava-hf/llava-v1.6-vicuna-7b-hf", _config(
        LlavaNextConfig, vision_config=CLIP_L_336, text_config=LLAMA_7B,
        image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]), _llava_next_processor),
    "llava_onevision": Real("llava-hf/llava-onevision-qwen2-7b-ov-hf", _config(
        LlavaOnevisionConfig, text_config={**QWEN2_7B, "model_type": "qwen2"},
        vision_config={"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26,
                       "num_attention_heads": 16, "image_size": 384, "patch_size": 14,
                       "model_type": "siglip_vision_model"},
        # 384 px tiles, 1x1 .. 6x6 of them
        image_grid_pinpoints=[[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]), _onevision_processor),
    "gemma3": Real("google/gemma-3-4b-it", _config(
        Gemma3Config, text_config={"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
        vision_config={"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                       "num_attention_heads": 16, "image_size": 896, "patch_size": 14},
        mm_tokens_per_image=256), _gemma3_processor),
    "internvl": Real("OpenGVLab/InternVL3-8B-hf", _config(
        InternVLConfig, text_config={**QWEN2_7B, "model_type": "qwen2"},
        vision_config={"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                       "num_attention_heads": 16, "image_size": [448, 448], "patch_size": [14, 14]},
        image_seq_length=256, downsample_ratio=0.5), _internvl_processor),
    "mistral3": Real("mistralai/Mistral-Small-3.1-24B-Instruct-2503", _config(
        Mistral3Config, text_config={"hidden_size": 5120, "intermediate_size": 32768, "num_hidden_layers": 40,
                                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                     "model_type": "mistral"},
        vision_config={"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                       "num_attention_heads": 16, "image_size": 1540, "patch_size": 14},
        spatial_merge_size=2), _mistral3_processor),
    "idefics3": Real("HuggingFaceM4/Idefics3-8B-Llama3", _config(
        Idefics3Config, text_config={**LLAMA_7B, "intermediate_size": 14336, "num_key_value_heads": 8},
        vision_config={"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                       "num_attention_heads": 16, "image_size": 364, "patch_size": 14},
        scale_factor=2), _idefics3_processor),
}


def sample_image() -> Image.Image:
    """A 1024x768 picture (the content does not change the token count; the size does)."""
    return Image.new("RGB", IMAGE_SIZE, (128, 64, 32))


def image_tokens(processor: Any, image_token_id: int, image: Image.Image, kwargs: dict[str, Any]) -> int:
    """How many image-token rows the processor writes for `image` (its span's image tokens)."""
    out = processor(text=[processor.image_token], images=[image], add_special_tokens=False, **kwargs)
    return sum(1 for t in out["input_ids"][0] if t == image_token_id)


def deepstack_layers(config: Any) -> int:
    return len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())


def tiny_built(family: str) -> Built:
    """The tiny builder's config, processor and tokenizer (no model: nothing is initialised)."""
    built: Built = importlib.import_module(f"epd_builders.families.{BUILDERS[family]}").build(TinySpec(family=family))
    return built


def family_bytes(family: str, image: Image.Image | None = None) -> tuple[FamilyBytes, FamilyBytes]:
    """(tiny, real) for one family."""
    image = image if image is not None else sample_image()
    built = tiny_built(family)
    adapter = adapter_for(built.config)
    kwargs, image_id = adapter.spec.processor_kwargs, adapter.image_token_id(built.config)
    tiny = FamilyBytes(family, "tiny", f"python -m epd_builders.tiny --family {family}",
                       image_tokens(built.processor, image_id, image, kwargs),
                       built.config.get_text_config().hidden_size, deepstack_layers(built.config), TINY_DTYPE_BYTES)
    real = REAL[family]
    config = real.config()
    processor = real.processor(config, built.tokenizer)  # same tokenizer: the same image token id
    big = FamilyBytes(family, "real", real.checkpoint, image_tokens(processor, image_id, image, kwargs),
                      config.get_text_config().hidden_size, deepstack_layers(config), REAL_DTYPE_BYTES)
    return tiny, big


def all_family_bytes(families: tuple[str, ...] = FAMILIES) -> list[FamilyBytes]:
    image = sample_image()
    return [row for f in families for row in family_bytes(f, image)]


def markdown(rows: list[FamilyBytes]) -> str:
    """The README's table: one line per family, tiny and real side by side."""
    lines = ["| family | tiny checkpoint (float32) | real-size checkpoint | its rows (bfloat16) | real bytes |",
             "|---|---|---|---|---|"]
    by_family: dict[str, dict[str, FamilyBytes]] = {}
    for r in rows:
        by_family.setdefault(r.family, {})[r.size] = r
    for family, sizes in by_family.items():
        tiny, real = sizes["tiny"], sizes["real"]
        lines.append(f"| {family} | {_product(tiny)} = {tiny.num_bytes:,} B | {real.checkpoint} | {_product(real)} | "
                     f"{real.num_bytes:,} B ({real.num_bytes / 2**20:.2f} MiB) |")
    return "\n".join(lines)


def _product(r: FamilyBytes) -> str:
    deep = f" x (1 + {r.deepstack_layers} DeepStack)" if r.deepstack_layers else ""
    return f"{r.image_tokens} x {r.hidden_size}{deep} x {r.dtype_bytes} B"


def main(argv: list[str] | None = None) -> None:
    p = parser("family_bytes", __doc__, "one JSON list instead of the markdown table")
    p.add_argument("--family", choices=FAMILIES, action="append", help="only these families (repeatable)")
    args = p.parse_args(argv)
    rows = all_family_bytes(tuple(args.family) if args.family else FAMILIES)
    emit([r.as_json() for r in rows], args.json, lambda _: markdown(rows), indent=1)


if __name__ == "__main__":
    main()
