"""Tiny EAGLE-3 heads for a target checkpoint, in the published format (random weights: what they test is that
verification keeps the target's output exact, whatever they propose).

    python -m epd_builders.eagle3 --target /tmp/tiny-qwen2_5_vl --out /tmp/eagle3-qwen2_5_vl

`config.json` is a one-layer Llama's (the target's hidden size, heads and vocabulary) with `draft_vocab_size` (half
the target's: every other target id, so `d2t` maps draft ids back) and `eagle_config.eagle_aux_hidden_state_layer_ids`
(the layers whose input hidden states the head reads: (2, L // 2, L - 3), or (0, L // 2, L - 1) for targets of fewer
than 5 layers); `model.safetensors` holds `fc`, `midlayer.*` (attention over [embedding; hidden], `hidden_norm`),
`norm`, `lm_head`, `d2t` and `t2d`, as EAGLE-3's own checkpoints do.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from epd_models.registry import load_config


def build_eagle3(target_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    text = load_config(target_dir).get_text_config()
    h, layers, vocab = int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size)
    heads, kv = int(text.num_attention_heads), int(text.num_key_value_heads)
    hd = int(getattr(text, "head_dim", None) or h // heads)
    aux = [2, layers // 2, layers - 3] if layers >= 5 else [0, layers // 2, layers - 1]
    draft_vocab = vocab // 2
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": 2 * h, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
              "hidden_act": "silu", "vocab_size": vocab, "draft_vocab_size": draft_vocab, "torch_dtype": "float32",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.5 / shape[-1] ** 0.5

    state = {"fc.weight": w(h, 3 * h), "norm.weight": torch.ones(h), "lm_head.weight": w(draft_vocab, h),
             "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
             "midlayer.post_attention_layernorm.weight": torch.ones(h),
             "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
             "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * h),
             "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * h),
             "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
             "midlayer.mlp.gate_proj.weight": w(2 * h, h), "midlayer.mlp.up_proj.weight": w(2 * h, h),
             "midlayer.mlp.down_proj.weight": w(h, 2 * h)}
    ids = torch.arange(draft_vocab)
    state["d2t"] = ids * 2 - ids  # draft id i -> target id 2i
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids * 2] = True
    state["t2d"] = t2d
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, out / "model.safetensors")
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m epd_builders.eagle3", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target checkpoint's directory")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(build_eagle3(args.target, args.out, args.seed))


if __name__ == "__main__":
    main()
