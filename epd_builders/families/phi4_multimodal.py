"""Tiny Phi-4-multimodal checkpoints (audio in, text out): a conformer audio encoder (8x conv subsampling, relative
attention bias) and a two-layer projection in front of a Phi-3-style LM.

Unlike the composite VLMs there is no language_model child: the LM is Phi4MultimodalModel itself (embed_tokens,
layers, norm) and the towers hang under it as model.embed_tokens_extend.{audio_embed,image_embed}. The audio
projection has two sets of weights, chosen by whether the prompt also holds an image ("speech" vs "vision"), so an
audio clip's rows depend on its prompt. The vision path is built (it needs no torchvision) but not exercised: the only
image processor transformers has imports torchvision. The real checkpoint also ships speech and vision LoRA adapters
for the LM (PEFT format, in speech-lora/ and vision-lora/): `write_shipped_loras` writes tiny random ones the same
way (AudioTinySpec.shipped_loras).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import Phi4MultimodalConfig, Phi4MultimodalFeatureExtractor, Phi4MultimodalForCausalLM
from transformers.models.phi4_multimodal.configuration_phi4_multimodal import (
    Phi4MultimodalAudioConfig,
    Phi4MultimodalVisionConfig,
)

from epd_builders.families.audio_common import SAMPLING_RATE, audio_chat_template, token_id, train_audio_tokenizer
from epd_builders.families.common import Built, special_ids
from epd_models.audio_processors import Phi4MultimodalAudioProcessor

MODEL_CLASS = Phi4MultimodalForCausalLM
IMAGE, AUDIO = "<|endoftext10|>", "<|endoftext11|>"  # the real tokenizer's (ids 200010, 200011)
MEL_BINS, TIME_REDUCTION = 80, 8
WINDOW_TOKENS = 500  # the encoder's attention window after subsampling (its max_seq_len): 4000 mel frames, 40 s
WINDOW_SECONDS = WINDOW_TOKENS * TIME_REDUCTION * 160 // SAMPLING_RATE
LM_PREFIXES = ("model.layers.", "model.embed_tokens.", "model.norm.")  # the encoder's: model.embed_tokens_extend
# the real checkpoint's adapters (speech r 320, alpha 640; vision r 256, alpha 512) on every LM layer's fused
# linears; these tiny ones keep alpha = 2r at ranks that fit the tiny LM
SHIPPED_LORAS = {"speech-lora": 8, "vision-lora": 4}
LORA_TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def build(spec: Any) -> Built:
    # the real template writes <|audio_1|> ... which its processor rewrites; the tiny one writes the token itself
    tok = train_audio_tokenizer([IMAGE, AUDIO], {"image_token": IMAGE, "audio_token": AUDIO},
                                audio_chat_template(IMAGE, None, AUDIO))
    vision = Phi4MultimodalVisionConfig(
        hidden_size=spec.vision_hidden, intermediate_size=spec.vision_hidden * 2, num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.heads, image_size=56, crop_size=56, patch_size=14,
        image_token_id=token_id(tok, IMAGE),
    )
    audio = Phi4MultimodalAudioConfig(
        hidden_size=spec.audio_hidden, intermediate_size=spec.audio_hidden * 2, num_blocks=spec.audio_layers,
        num_attention_heads=spec.audio_heads, ext_pw_out_channel=spec.audio_hidden,
        depthwise_separable_out_channel=spec.audio_hidden, nemo_conv_channels=spec.audio_hidden,
        input_size=MEL_BINS, time_reduction=TIME_REDUCTION, audio_token_id=token_id(tok, AUDIO),
    )
    cfg = Phi4MultimodalConfig(
        vocab_size=len(tok), hidden_size=spec.text_hidden, intermediate_size=spec.text_hidden * 2,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=4096, original_max_position_embeddings=4096, tie_word_embeddings=False,
        vision_config=vision, audio_config=audio, **special_ids(tok),
    )
    fe = Phi4MultimodalFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE,
                                        audio_compression_rate=TIME_REDUCTION)
    processor = Phi4MultimodalAudioProcessor(audio_processor=fe, tokenizer=tok, chat_template=tok.chat_template)
    return Built(cfg, processor, tok)


def audio_tokens(num_samples: int, processor: Any) -> int:
    """The audio tokens for a clip of `num_samples` (at 16 kHz): one mel frame per 10 ms hop of a 25 ms window,
    then ceil(frames / 8) (12.5 per second, no upper bound: the processor never cuts a clip)."""
    fe = processor.audio_processor
    frames = (num_samples - int(fe.win_length)) // int(fe.hop_length) + 1
    return math.ceil(math.ceil(frames / int(fe.audio_compression_rate)) / int(fe.audio_downsample_rate))


def write_shipped_loras(model: Any, out: Path) -> None:
    """speech-lora/ and vision-lora/ in `out`, PEFT's format (adapter_config.json, adapter_model.safetensors keyed
    base_model.model.<module>.lora_{A,B}.weight), random A and B large enough to change a greedy answer."""
    for i, (folder, rank) in enumerate(SHIPPED_LORAS.items()):
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for layer in range(model.config.num_hidden_layers):
            for target in LORA_TARGETS:
                name = f"model.layers.{layer}.{target}"
                linear = model.get_submodule(name)
                for half, shape in (("A", (rank, linear.in_features)), ("B", (linear.out_features, rank))):
                    tensors[f"base_model.model.{name}.lora_{half}.weight"] = torch.randn(shape, generator=gen) * 0.2
        (out / folder).mkdir()
        save_file(tensors, str(out / folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        targets = r"model\.layers\.\d+\.(self_attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj)"
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                  "lora_dropout": 0.0, "bias": "none", "target_modules": targets, "modules_to_save": [],
                  "base_model_name_or_path": None, "inference_mode": True}
        (out / folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
