"""Random checkpoints with the real shapes of LLaVA-1.5-7B and Qwen2.5-VL-3B, built on the device (`make gpu-check`).

    python -m epd_builders.full_size --preset llava-1.5-7b [--size small] [--device cuda] [--out DIR] [--json]

Nothing is downloaded: the config is built from transformers' classes at the real sizes, the tokenizer is the small
one epd_builders/tokenizer.py trains (its chat template, processors as the tiny builders make them), and the
embedding table and LM head have the real vocabulary (rows past the tokenizer's, and tokens that decode to no text,
are zeroed in the LM head, so greedy decoding always emits text: bench_model.save_checkpoint). Weights are random:
the model is built with its parameters on meta, then each is made on `device` in the config's dtype (bf16 at
full size) and filled (normal(0, 0.02); 1-D weights 1, biases 0). transformers' own init is skipped: on a CPU it
costs minutes for a 7B model (bf16 normal_ is single-threaded there). `--size small`: the same families, processors,
image geometry and vocabularies with a tiny tower and LM in float32, for the CPU dry run.

Where the full-size numbers come from (transformers 5.24 as installed; hub values from the checkpoints' config.json):
  LLaVA-1.5-7B (llava-hf/llava-1.5-7b-hf)
    tower CLIP ViT-L/14 at 336 px, hidden 1024, 24 layers, 16 heads, MLP 4096, patch 14: LlavaConfig's default
      vision_config (models/llava/configuration_llava.py); quick_gelu and LayerNorm eps 1e-5: CLIPVisionConfig defaults
    projector: 2 linear layers with GELU between (projector_hidden_act "gelu", with biases); features of layer -2,
      CLS dropped ("default"): LlavaConfig defaults
    LM Llama-2-7B, hidden 4096, 32 layers, 32 heads (as many K/V heads), MLP 11008: LlamaConfig defaults; vocab 32064
      (32000 + <image> + <pad>, padded to 64), 4096 positions and RMSNorm eps 1e-5: the hub config (LlamaConfig's
      defaults are 32000, 2048 and 1e-6)
  Qwen2.5-VL-3B (Qwen/Qwen2.5-VL-3B-Instruct)
    tower: depth 32, 16 heads, MLP 3420, patch 14, spatial merge 2, temporal patch 2, window 112, full attention in
      blocks 7, 15, 23, 31: Qwen2_5_VLVisionConfig defaults; hidden 1280 and out_hidden 2048: the hub config (the
      defaults, 3584 and 3584, are the 7B's LM width)
    LM: hidden 2048, 36 layers, 16 heads, 2 K/V heads, MLP 11008, vocab 151936, tied embeddings, 128000 positions,
      RMSNorm eps 1e-6, M-RoPE sections [16, 24, 24] (sum: head_dim / 2 = 64): the hub config (Qwen2_5_VLTextConfig's
      defaults are the 72B's); rope theta 1e6: Qwen2_5_VLTextConfig.default_theta
    processor: 3136 to 12845056 pixels (56 x 56 to 28 x 28 x 16384): the hub's preprocessor_config.json
tests/bench/test_full_size.py checks the transformers defaults named here and the parameter counts the hub
publishes (7.06B, 3.75B).

Built once into the cache directory of bench_model (`$EPD_CACHE_DIR`, ...) under `<preset>[-small]-<digest of the
spec>`; a second run reuses it, and a changed spec builds afresh and removes the preset's stale builds (GBs each).
The device the weights were drawn on is not in the digest: the values differ, the cost does not.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLVisionConfig

from epd_builders.bench_model import cache_root, ensure_built, save_checkpoint
from epd_builders.families.common import special_ids
from epd_builders.families.llava import llava_config, llava_processor
from epd_builders.families.qwen import QWEN_IMAGE_MARKUP, qwen_processor, qwen_token_ids
from epd_builders.tokenizer import train_tokenizer
from epd_models.meta import params_on_meta
from epd_models.processors import Qwen2_5_VLImageProcessorOnly


@dataclass(frozen=True)
class FullSizeSpec:
    family: str  # "llava" (LLaVA-1.5) or "qwen2_5_vl"
    vision_hidden: int
    vision_intermediate: int
    vision_layers: int
    vision_heads: int
    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    patch: int = 14
    image_size: int = 336  # LLaVA: the square input
    min_pixels: int = 56 * 56  # Qwen: the processor's pixel bounds
    max_pixels: int = 28 * 28 * 16384
    window_size: int = 112  # Qwen tower: window attention, full attention in these blocks
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    mrope_section: tuple[int, ...] = (16, 24, 24)
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.family in ("llava", "qwen2_5_vl"), f"unknown family {self.family!r}"

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


LLAVA_7B = FullSizeSpec("llava", vision_hidden=1024, vision_intermediate=4096, vision_layers=24, vision_heads=16,
                        text_hidden=4096, text_intermediate=11008, text_layers=32, text_heads=32, text_kv_heads=32,
                        vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5)
QWEN25_VL_3B = FullSizeSpec("qwen2_5_vl", vision_hidden=1280, vision_intermediate=3420, vision_layers=32,
                            vision_heads=16, text_hidden=2048, text_intermediate=11008, text_layers=36, text_heads=16,
                            text_kv_heads=2, vocab_size=151936, max_position_embeddings=128000, rms_norm_eps=1e-6,
                            tie_word_embeddings=True)
PRESETS = {"llava-1.5-7b": LLAVA_7B, "qwen2.5-vl-3b": QWEN25_VL_3B}
SIZES = ("full", "small")
# --size small: width 64, 2 LM layers, 4 heads; head_dim 16, so 8 rotary pairs for M-RoPE; the Qwen tower keeps a
# window block and a full-attention block
SMALL = dict(vision_hidden=64, vision_intermediate=128, vision_heads=4, text_hidden=64, text_intermediate=128,
             text_layers=2, text_heads=4, mrope_section=(2, 3, 3), dtype="float32")
SMALL_BY_FAMILY = {"llava": dict(vision_layers=2, text_kv_heads=4),
                   "qwen2_5_vl": dict(vision_layers=2, text_kv_heads=2, fullatt_block_indexes=(1,))}


def preset(name: str, size: str = "full") -> FullSizeSpec:
    assert name in PRESETS and size in SIZES, f"unknown preset/size {name!r}/{size!r}; one of {list(PRESETS)}/{SIZES}"
    spec = PRESETS[name]
    return spec if size == "full" else replace(spec, **SMALL, **SMALL_BY_FAMILY[spec.family])  # type: ignore[arg-type]


def config_and_processor(spec: FullSizeSpec) -> tuple[Any, Any, Any]:
    """(config, processor, tokenizer) for spec: no weights."""
    return _llava(spec) if spec.family == "llava" else _qwen(spec)


def _llava(spec: FullSizeSpec) -> tuple[Any, Any, Any]:
    tok = train_tokenizer("<image>", "<image>")
    vision: dict[str, Any] = dict(hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
                                  num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
                                  image_size=spec.image_size, patch_size=spec.patch)
    text: dict[str, Any] = dict(hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
                                num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
                                num_key_value_heads=spec.text_kv_heads, rms_norm_eps=spec.rms_norm_eps,
                                max_position_embeddings=spec.max_position_embeddings)
    cfg: Any = llava_config(tok, vision, text)
    cfg.text_config.vocab_size = spec.vocab_size  # llava_config's is the tokenizer's
    cfg.vision_feature_layer = -2  # LLaVA-1.5's (the tiny builder's is -1)
    return cfg, llava_processor(tok, spec.image_size, spec.patch), tok


def _qwen(spec: FullSizeSpec) -> tuple[Any, Any, Any]:
    tok = train_tokenizer("<|image_pad|>", QWEN_IMAGE_MARKUP)
    text: dict[str, Any] = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=spec.tie_word_embeddings, **special_ids(tok),
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "mrope_section": list(spec.mrope_section)})
    vision = Qwen2_5_VLVisionConfig(
        depth=spec.vision_layers, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
        num_heads=spec.vision_heads, out_hidden_size=spec.text_hidden, patch_size=spec.patch, spatial_merge_size=2,
        temporal_patch_size=2, window_size=spec.window_size, tokens_per_second=2,
        fullatt_block_indexes=list(spec.fullatt_block_indexes))
    cfg = Qwen2_5_VLConfig(text_config=Qwen2_5_VLTextConfig(**text), vision_config=vision,
                           tie_word_embeddings=spec.tie_word_embeddings, **qwen_token_ids(tok))
    processor = qwen_processor(Qwen2_5_VLImageProcessorOnly, tok, spec.patch, spec.min_pixels, spec.max_pixels)
    return cfg, processor, tok


def random_model(cfg: Any, std: float, device: str | torch.device) -> Any:
    """The model for cfg in cfg.dtype, every parameter drawn on `device` (tied ones stay one tensor)."""
    with params_on_meta():
        model = AutoModelForImageTextToText.from_config(cfg)
    drawn: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its random tensor
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in drawn:
                drawn[id(p)] = nn.Parameter(_draw(name, p, std, torch.device(device)), requires_grad=False)
            setattr(module, name, drawn[id(p)])
    model.tie_weights()  # NOTE: params_on_meta gives each registration its own meta tensor: ties are made here
    return model.to(device).eval()  # the buffers (rotary frequencies, position ids) too


def _draw(name: str, meta: torch.Tensor, std: float, device: torch.device) -> torch.Tensor:
    t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    if name == "bias":
        return t.zero_()
    if meta.dim() == 1 and name == "weight":  # LayerNorm / RMSNorm scales
        return t.fill_(1.0)
    return t.normal_(0.0, std)


def build_full_size(spec: FullSizeSpec, out_dir: str | Path, device: str | torch.device = "cpu") -> Path:
    """Build the random checkpoint for spec with its weights drawn on `device`, save it (and its tokenizer and
    processor) to out_dir."""
    out = Path(out_dir)
    torch.manual_seed(spec.seed)
    cfg, processor, tok = config_and_processor(spec)
    cfg.dtype = spec.dtype  # what the workers load it as (--dtype auto)
    for sub in (cfg.vision_config, cfg.text_config):
        sub.dtype = spec.dtype
    model = random_model(cfg, spec.init_std, device)
    with torch.no_grad():
        model.lm_head.weight[len(tok):] = 0.0  # ids no tokenizer entry decodes
    save_checkpoint(model, tok, processor, True, out)
    return out


def full_size_dir(name: str, size: str = "full") -> Path:
    return cache_root() / "models" / f"{name}{'' if size == 'full' else '-' + size}-{preset(name, size).digest}"


def ensure_full_size(name: str, size: str = "full", device: str = "cpu") -> Path:
    """The cached build of preset `name` at `size`, built first on `device` if absent; other digests of the same
    preset and size are removed."""
    target = full_size_dir(name, size)
    path = ensure_built(target, lambda out: build_full_size(preset(name, size), out, device))
    stale = re.compile(re.escape(target.name[:-12]) + "[0-9a-f]{12}")
    for old in target.parent.iterdir():
        if old != target and stale.fullmatch(old.name):
            shutil.rmtree(old, ignore_errors=True)
    return path


def describe(model_dir: Path) -> dict[str, Any]:
    """Parameters, safetensors bytes and dtypes of a saved checkpoint, read from the file headers only."""
    files = sorted(model_dir.glob("*.safetensors"))
    shapes, dtypes = [], set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                part = f.get_slice(key)
                shapes.append(part.get_shape())
                dtypes.add(part.get_dtype())
    return {"path": str(model_dir), "parameters": sum(int(torch.Size(s).numel()) for s in shapes),
            "safetensors_bytes": sum(p.stat().st_size for p in files), "dtypes": sorted(dtypes)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epd_builders.full_size", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--size", choices=SIZES, default="full", help="small: the same family at tiny shapes")
    p.add_argument("--device", default="cpu", help="where the weights are drawn: cpu, cuda or cuda:N")
    p.add_argument("--out", type=Path, default=None, help="build here instead of the cache directory")
    p.add_argument("--json", action="store_true", help="print the checkpoint's facts and build time as JSON")
    args = p.parse_args(argv)
    started, cached = time.monotonic(), args.out is None and full_size_dir(args.preset, args.size).exists()
    if args.out is not None:
        path = build_full_size(preset(args.preset, args.size), args.out, args.device)
    else:
        path = ensure_full_size(args.preset, args.size, args.device)
    if not args.json:
        print(path)
        return
    facts = {**describe(path), "cached": cached, "seconds": round(time.monotonic() - started, 1)}
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
